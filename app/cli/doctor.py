"""`specchat doctor`: what this machine's CPU kernels (the native library) are doing, and `--rebuild-native` to
build them again.

Contract: ``run(args)`` (``args.rebuild_native``) prints, one line each, where the library of this machine's
build key lives and whether it checks out (its sha256 against its build's record; nothing is loaded to find
out), or why no build can run here; with ``--rebuild-native`` it removes that key's cached library, failure note
and build folder, builds it in the foreground (progress on stderr), loads it, and prints what it did. Returns 0,
or 1 when the library is not usable at the end.
"""

from __future__ import annotations

import argparse
import sys


def run(args: argparse.Namespace) -> int:
    from specchat.app.cli.generate import _progress
    from specchat.backend.kernels import native, native_build

    why = native_build.unavailable()
    library = native.library()
    if library is None:
        print(f"specchat doctor: the CPU kernels cannot be built here: {why}")
        return 1
    folder = library.folder
    print(f"specchat doctor: CPU kernels for this machine: {folder.library}")
    if not getattr(args, "rebuild_native", False):
        state = folder.verified()
        failed = folder.failure_record()
        holder = folder.holder()
        if state is None:
            print("specchat doctor: built, and its sha256 matches its build's record")
        elif holder is not None:
            print(f"specchat doctor: {holder} is building it now (log: {folder.log})")
        elif failed is not None and state == "not built yet":
            print(
                f"specchat doctor: {failed.reason} (log: {folder.log}; {failed.count} failed build(s) in a row); a "
                f"start tries again after {failed.when_retried()}, `specchat doctor --rebuild-native` now"
            )
        else:
            print(f"specchat doctor: {state}; the next start builds it (or run `specchat doctor --rebuild-native`)")
        return 0
    print(f"specchat doctor: rebuilding (a few minutes on 2 cores; the log is {folder.log})", flush=True)
    why, notes = native.rebuild(progress=_progress)
    for note in notes:
        print(f"specchat doctor: {note}")
    if why is not None:
        print(f"specchat doctor: the CPU kernels are unavailable: {why}", file=sys.stderr)
        return 1
    took = f" in {library.built_s:.0f} s" if library.built_s is not None else ""
    print(f"specchat doctor: built{took} and loaded; the kernels run {native.isa()} code on this CPU")
    return 0
