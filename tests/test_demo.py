"""The demo's picture and its bit-for-bit claim: two panels (loss by step zoomed on the last stretch,
held-out loss against the bytes sent, log x), held-out curves, and "fp32 = torch, bit for bit" in the
legend only when the demo checked it."""
from __future__ import annotations

import math

import pytest

from flatcomm.tools import demo


def _results(same: bool = True) -> list:
    out = []
    for i, (label, codec) in enumerate(demo.RUNS):
        offset = 0.01 * max(i - 1, 0)  # fp32 (i = 1) trains like torch (i = 0)
        losses = [4.0 * math.exp(-s / 10) + 2.0 + offset for s in range(60)]
        if codec == "fp32" and not same:
            losses[-1] += 1e-7
        val = [(s, x + 0.1) for s, x in zip(range(1, 61, 10), losses[::10])] + [(60, losses[-1] + 0.1)]
        per_step = 400_000 / (i + 1)
        out.append({"label": label, "codec": codec, "losses": losses, "val_curve": val, "val_loss": val[-1][1],
                    "bytes_per_step": per_step, "bytes_sent": [s * per_step for s, _ in val],
                    "sha256": "ab" if codec in (None, "fp32") else f"{i}"})
    return out


def test_fp32_matches_torch_compares_weights_and_every_loss():
    assert demo.fp32_matches_torch(_results())
    assert not demo.fp32_matches_torch(_results(same=False))  # one step's loss differs
    other = _results()
    other[1]["sha256"] = "cd"
    assert not demo.fp32_matches_torch(other)
    assert not demo.fp32_matches_torch(_results()[2:])  # nothing to compare


@pytest.mark.parametrize("same", [True, False])
def test_figure_has_bytes_panel_zoom_and_honest_legend(same):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    fig = demo.figure(_results(), same)
    try:
        ax, bx = fig.axes
        assert bx.get_xscale() == "log" and "MB" in bx.get_xlabel()
        lo, hi = ax.get_ylim()
        assert hi < 4.0 and lo > 1.9  # the first drop (to 6.0) is cut off: the last stretch fills the axis
        labels = [t.get_text() for t in fig.legends[0].get_texts()]
        assert len(labels) == len(demo.RUNS) and all("held-out" in t for t in labels)
        assert any("bit for bit" in t for t in labels) == same
        assert [len(line.get_xdata()) for line in bx.get_lines()] == [7] * len(demo.RUNS)  # held-out points
    finally:
        plt.close(fig)


def test_demo_run_checks_fp32_against_torch(tmp_path, capsys):
    """A 3-step run: held-out curve and bytes sent per run, and the printed check."""
    pytest.importorskip("matplotlib")
    png = tmp_path / "d.png"
    assert demo.main(["--steps", "3", "--out", str(png)]) == 0
    out = capsys.readouterr().out
    assert "flatcomm fp32 vs torch allreduce: the same bits" in out and png.stat().st_size > 0
