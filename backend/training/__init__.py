"""Training draft heads for a pair's target (`specchat train-head`): the target's own replies and features
(``data.py``), the training loop with checkpoints (``loop.py``), and the whole run with its acceptance report
(``pipeline.py``). Built on the engine (generation, the runner's taps) and ``speculative/heads``."""
