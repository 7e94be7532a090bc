"""What speculative decoding did in a bench run: acceptance from the scheduler's counters, and the speedup
against the same run without it."""

from __future__ import annotations

from typing import Any

from pagellm.engine.scheduler import SchedulerStats


def acceptance(before: SchedulerStats, after: SchedulerStats) -> dict[str, Any]:
    """Drafts verified and accepted between two snapshots of the scheduler's stats. `mean_acceptance_length`
    is the tokens a verifying step gave a request on average (accepted drafts + the target's own)."""
    drafts = after.spec_num_drafts - before.spec_num_drafts
    tokens = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    per_position = [
        a - (before.spec_accepted_per_position[i] if i < len(before.spec_accepted_per_position) else 0)
        for i, a in enumerate(after.spec_accepted_per_position)
    ]
    return {
        "num_drafts": drafts,
        "num_draft_tokens": tokens,
        "num_accepted_tokens": accepted,
        "acceptance_rate": accepted / tokens if tokens else None,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "acceptance_rate_by_position": [a / drafts for a in per_position] if drafts else [],
    }


def format_acceptance(report: dict[str, Any]) -> str:
    if not report["num_draft_tokens"]:
        return "speculative decoding: no drafts were proposed (nothing for the proposer to match)"
    positions = ", ".join(f"{r:.0%}" for r in report["acceptance_rate_by_position"])
    return (
        f"speculative decoding: {report['num_accepted_tokens']} of {report['num_draft_tokens']} drafts accepted "
        f"({report['acceptance_rate']:.1%}); mean acceptance length {report['mean_acceptance_length']:.2f} "
        f"tokens per verifying step; accepted by draft position: {positions}"
    )
