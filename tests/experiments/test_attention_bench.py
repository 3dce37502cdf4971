"""attention_bench's run and figure: the error checks after the timings (a compile each, seconds
per check on a CPU) advance a progress bar of their own, and an implementation skipped on this
backend draws no bars. Nothing is timed for real: the measuring functions are replaced."""

import pytest

from experiments import attention_bench, common


@pytest.fixture
def no_timing(monkeypatch):
    monkeypatch.setattr(common, "timed_calls", lambda fn, args, reps, warmup=0: [1e-3] * reps)
    monkeypatch.setattr(attention_bench, "check", lambda *a, **k: {"o": 0.0, "dq": 0.0, "dk": 0.0, "dv": 0.0})


def test_checks_advance_a_progress_bar(tmp_path, monkeypatch, no_timing):
    bars, make = [], common.progress

    def recording(*a, **kw):
        bars.append((kw["desc"], make(*a, **kw)))
        return bars[-1][1]

    monkeypatch.setattr(common, "progress", recording)
    rec = attention_bench.run(quick=True, out=str(tmp_path), shapes="1x32", impls="xla", layouts="mha,gqa", reps=1)
    assert len(rec["checks"]) == 4  # two layouts, with and without segments
    checks = [bar for desc, bar in bars if "check" in desc]
    assert len(checks) == 1, [desc for desc, _ in bars]
    assert checks[0].total == checks[0].n == 4


def test_plot_leaves_out_a_skipped_impl():
    record = {"impls": ["xla", "cudnn"], "device": {"description": "1 x cpu (cpu)"},
              "results": [{"impl": "xla", "layout": "mha", "batch": 1, "seq_len": 32, "segments": s, "fwd_bwd_ms": 1.0}
                          for s in (False, True)]}
    fig = attention_bench.plot(record)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["xla"]
    assert len(ax.patches) == 2  # one bar per case, none of height 0 for cudnn
