"""The job state machine: legal moves only, terminal states stay terminal."""

from __future__ import annotations

import pytest

from services.store import states


def test_every_state_has_a_transition_entry_and_a_proto_value() -> None:
    for s in states.ALL_STATES:
        assert s in states.LEGAL_TRANSITIONS
        assert states.from_proto(states.to_proto(s)) == s


def test_the_happy_path_is_legal() -> None:
    states.check_history(
        ["QUEUED", "PENDING", "DEPLOYING", "DOWNLOADING", "PROCESSING", "STORING", "COMPLETED"]
    )


def test_halt_and_resume_path_is_legal() -> None:
    states.check_history(
        ["QUEUED", "PENDING", "DEPLOYING", "PROCESSING", "HALTED", "RESUMING", "PROCESSING"]
    )


@pytest.mark.parametrize(
    ("current", "target"),
    [
        ("QUEUED", "PROCESSING"),
        ("COMPLETED", "PROCESSING"),
        ("FAILED", "QUEUED"),
        ("DELETED", "QUEUED"),
        ("PROCESSING", "PROCESSING"),
    ],
)
def test_illegal_transitions_are_refused_with_the_allowed_ones(current: str, target: str) -> None:
    assert not states.is_legal(current, target)
    message = str(states.IllegalTransition("job-1", current, target))
    assert f"cannot go from {current} to {target}" in message
    assert "allowed from" in message


def test_a_history_with_an_illegal_step_is_caught() -> None:
    with pytest.raises(states.IllegalTransition, match="cannot go from PENDING to COMPLETED"):
        states.check_history(["QUEUED", "PENDING", "COMPLETED"])


def test_terminal_states_only_lead_to_deleted() -> None:
    for s in states.TERMINAL_STATES:
        assert states.LEGAL_TRANSITIONS[s] <= {"DELETED"}
