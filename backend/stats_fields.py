"""The names of RequestStats' fields that other code lists (split from ``backend/api.py``, which re-exports
:data:`JSON_STATS_FIELDS`): pure data, no imports."""

# The `specchat generate --json` "stats" object: these fields, in this order, and no others.
JSON_STATS_FIELDS = (
    "new_tokens",
    "wall_s",
    "prefill_s",
    "ttft_s",
    "prefill_tokens",
    "tok_s",
    "steps",
    "spec_paused_steps",
    "drafted",
    "accepted",
    "rejected",
    "discarded",
    "acceptance_rate",
    "mean_accepted_length",
    "per_position_acceptance",
    "gamma",
    "no_draft_steps",
    "draft_prefill_tokens",
    "draft_reused_tokens",
    "accepted_prediction_tokens",
    "rejected_prediction_tokens",
)

# The RequestStats fields a remote reply leaves None unless its server reports them (backend/remote/stats.py).
SERVER_FIELDS = (
    "prefill_s",
    "prefill_tokens",
    "steps",
    "spec_paused_steps",
    "drafted",
    "accepted",
    "rejected",
    "discarded",
    "draft_s",
    "verify_s",
    "overhead_s",
    "last_gamma",
    "acceptance_rate",
    "mean_accepted_length",
    "tokens_per_step",
    "alpha_hat",
    "expected_speedup",
    "spec_tok_s",
    "plain_tok_s",
)

# RequestStats' number fields that may be None (JSON null) when read back (``RequestStats.from_dict``): what a
# remote server may not report, a reply without tokens' rates, a reply without a prediction or a constraint.
OPTIONAL_NUMBERS = {
    *SERVER_FIELDS,
    "ttft_s",
    "tok_s",
    "accepted_prediction_tokens",
    "rejected_prediction_tokens",
    "mask_s",
}
