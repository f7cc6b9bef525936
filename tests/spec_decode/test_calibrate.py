"""The start-up verify-cost curve (spec_decode/calibrate.py) takes each shape's fastest of
REPEATS rounds over all shapes, so a slow spell of the machine that spans several
consecutive steps does not make one step size look dearer than its neighbours."""

from __future__ import annotations

from tokenmill.spec_decode import calibrate


def test_rounds_over_all_shapes_take_each_shapes_best(monkeypatch):
    calls: list[tuple[int, int]] = []

    def fake_step(runner, kv, params, num_seqs, tokens):
        calls.append((num_seqs, tokens))
        if num_seqs * tokens > 12:
            return None  # its KV blocks do not fit
        slow = 5 <= len(calls) <= 9  # a spell spanning five consecutive steps
        return tokens * num_seqs * (10.0 if slow else 1.0)

    monkeypatch.setattr(calibrate, "_step", fake_step)
    curve = calibrate.measure_cost_curve(None, None, max_drafts=3, max_tokens=64, max_seqs=4)
    # T = 1..4 for one sequence, then 2 x 4 = 8; 4 x 4 = 16 does not fit and is left out
    assert dict(zip(curve.tokens, curve.seconds)) == {1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0, 8: 8.0}
    shapes = [(1, 1), (1, 2), (1, 3), (1, 4), (2, 4), (4, 4)]
    rounds = calls[1:]  # after the warm-up step
    assert rounds[: len(shapes)] == shapes  # the first round tries every shape once
    assert (4, 4) not in rounds[len(shapes) :]  # a shape that did not fit is not retried
    assert len(rounds) == len(shapes) + (calibrate.REPEATS - 1) * (len(shapes) - 1)
