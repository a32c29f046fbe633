"""MetricsWriter files, progress bar text, rollout statistics by hand, FLOP formula by hand."""

import io
import math

import pytest

from rstar_jax.rollout.records import trajectory_record
from rstar_jax.rollout.stats import record_stats, rollout_stats
from rstar_jax.rollout.trajectory import Trajectory
from rstar_jax.train.metrics import (
    MetricsWriter,
    ProgressBar,
    flops_per_token,
    format_duration,
    qwen3_matmul_params,
    read_metrics,
    throughput,
)


def _read_tb_scalars(logdir):
    """Parses TFRecord-framed event files (u64 length, u32 masked crc, payload, u32 masked crc) with
    tensorboardX's CRC-32C and its `Event` protocol buffer (TensorBoard's schema): the checksums must
    hold and the first event of each file must be its version record, as TensorBoard's reader wants."""
    import struct

    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.record_writer import masked_crc32c

    out = {}
    files = sorted(logdir.glob("events.out.tfevents.*"))
    assert files, "no event file written"
    for path in files:
        data = path.read_bytes()
        offset, events = 0, []
        while offset < len(data):
            header = data[offset:offset + 8]
            (length,) = struct.unpack("<Q", header)
            assert struct.unpack("<I", data[offset + 8:offset + 12])[0] == masked_crc32c(header), path
            payload = data[offset + 12:offset + 12 + length]
            assert struct.unpack("<I", data[offset + 12 + length:offset + 16 + length])[0] == masked_crc32c(payload)
            events.append(Event.FromString(payload))
            offset += 16 + length
        assert events and events[0].file_version == "brain.Event:2", path
        for event in events[1:]:
            assert event.wall_time > 1.7e9
            for value in event.summary.value:
                out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


def test_event_records_match_tensorboardx_byte_for_byte():
    """A scalar event as tensorboardX frames and serializes it (one value per event; its writer
    also stamps the time) is byte-identical to ours, negative steps and large values included."""
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.proto.summary_pb2 import Summary
    from tensorboardX.record_writer import masked_crc32c as tbx_masked_crc32c

    from rstar_jax.train.tb_events import event_bytes, masked_crc32c, record_bytes

    for step, tag, value in ((0, "a", 0.0), (7, "eval/pass@1", 0.96875), (-3, "lr", 1e-6), (2**40, "x/y_z", 3e38)):
        theirs = Event(wall_time=1796190000.25, step=step,
                       summary=Summary(value=[Summary.Value(tag=tag, simple_value=value)])).SerializeToString()
        assert event_bytes(1796190000.25, step, scalars=[(tag, value)]) == theirs
    version = Event(wall_time=1.5, step=0, file_version="brain.Event:2").SerializeToString()
    assert event_bytes(1.5, 0, file_version="brain.Event:2") == version
    for payload in (b"", version, bytes(range(256)) * 3):
        assert masked_crc32c(payload) == tbx_masked_crc32c(payload)
    assert record_bytes(version)[12:-4] == version


def test_writer_jsonl_tensorboard_and_close(tmp_path):
    import numpy as np

    with MetricsWriter(tmp_path) as writer:
        writer.write(1, {"reward_mean": np.float32(0.25), "lr": 1e-6, "stage": "stage1", "hist": np.arange(3)})
        writer.write(2, {"reward_mean": 0.5, "nan_metric": float("nan")})
        # Lines are on disk before close (a SIGKILLed run keeps them).
        assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
        with pytest.raises(ValueError, match="reserved"):
            writer.write(3, {"step": 1})
    writer.close()  # idempotent
    with pytest.raises(RuntimeError, match="after close"):
        writer.write(4, {"x": 1})
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["reward_mean"] == 0.25 and records[0]["stage"] == "stage1" and records[0]["hist"] == [0, 1, 2]
    assert math.isnan(records[1]["nan_metric"])

    scalars = _read_tb_scalars(tmp_path / "tb")
    assert scalars["reward_mean"] == [(1, 0.25), (2, 0.5)]
    assert scalars["lr"] == [(1, pytest.approx(1e-6))]
    assert "stage" not in scalars and "hist" not in scalars

    from rstar_jax.config import REPO_CONFIGS, load_config_file

    config = load_config_file(REPO_CONFIGS / "tiny.py")
    config.update_from_flattened_dict({"run_dir": str(tmp_path / "only_jsonl"), "metrics.tensorboard": False})
    from rstar_jax.app import builders

    with builders.metrics_writer(config) as writer:
        writer.write(0, {"a": 1})
    assert not (tmp_path / "only_jsonl" / "tb").exists()
    assert read_metrics(tmp_path / "only_jsonl")[0]["a"] == 1


def test_progress_bar_plain_text_with_eta():
    now = [100.0]
    stream = io.StringIO()  # not a TTY: the first line, then one per 5% and 30 s
    bar = ProgressBar(10, desc="stage1", width=10, stream=stream, clock=lambda: now[0])
    assert "ETA" not in bar.update(0)
    now[0] += 4.0
    line = bar.update(2, reward=0.41234, kept=3)
    # 2 steps in 4 s -> 2.00 s/step, 8 steps left -> 16 s.
    assert line == "[stage1] 2/10 [##........] 20% 2.00s/step ETA 16s reward=0.4123 kept=3"
    assert bar.last_line == line and stream.getvalue() == "[stage1] 0/10 [..........] 0%\n"  # 4 s after the first
    now[0] += 96.0
    assert bar.update(5).endswith("20.00s/step ETA 1m40s")
    lines = stream.getvalue().splitlines()
    assert lines == ["[stage1] 0/10 [..........] 0%", bar.last_line] and "\r" not in stream.getvalue()
    bar.close()  # the last update was printed
    assert stream.getvalue().splitlines() == lines
    assert format_duration(3725) == "1h02m" and format_duration(float("nan")) == "?"
    with pytest.raises(ValueError):
        ProgressBar(0)


def _log_bar(total, desc="sft"):
    """A bar on a non-TTY stream with a clock the test moves."""
    now = [0.0]
    stream = io.StringIO()
    return ProgressBar(total, desc=desc, stream=stream, clock=lambda: now[0]), stream, now


def _printed_steps(stream, desc="sft"):
    lines = stream.getvalue().splitlines()
    return [int(line.split()[1].split("/")[0]) for line in lines if line.startswith(f"[{desc}] ")]


def test_progress_bar_in_a_log_prints_one_line_per_5_percent_or_30_s_whichever_comes_later():
    # The default run's SFT warm-up: 2150 steps at 0.2 s. 5% is 107.5 steps (21.5 s), so the 30 s
    # decide: a line every 150 steps, instead of 2150 lines.
    bar, stream, now = _log_bar(2150)
    for step in range(1, 2151):
        now[0] = step * 0.2
        bar.update(step, loss=f"{1 / step:.3f}")
    lines = stream.getvalue().splitlines()
    assert len(lines) < 45 and "\r" not in stream.getvalue()
    assert lines[0].startswith("[sft] 1/2150 ") and lines[0].endswith("loss=1.000")
    assert lines[-1] == bar.last_line and lines[-1].startswith("[sft] 2150/2150 [####################] 100% 0.20s/step")
    steps = _printed_steps(stream)
    assert all(150 <= b - a <= 151 for a, b in zip(steps[:-2], steps[1:-1])), steps  # >= 30 s apart
    bar.close()  # the last step was printed
    assert stream.getvalue().splitlines() == lines
    # Slow steps: 5% of 100 steps is 5 steps of 10 s, later than 30 s.
    bar, stream, now = _log_bar(100, desc="rl")
    for step in range(1, 101):
        now[0] = step * 10.0
        bar.update(step, reward="0.50")
    assert _printed_steps(stream, "rl") == [*range(1, 100, 5), 100]


def test_progress_bar_close_prints_the_update_a_log_did_not_show():
    bar, stream, now = _log_bar(2150)
    for step in range(1, 41):  # a stage that ends early: 40 steps in 8 s, only the first printed
        now[0] = step * 0.2
        bar.update(step, loss="0.500")
    assert _printed_steps(stream) == [1]
    bar.close()
    assert _printed_steps(stream) == [1, 40] and stream.getvalue().splitlines()[-1] == bar.last_line
    bar.close()  # once
    assert _printed_steps(stream) == [1, 40]


def test_progress_bar_on_a_terminal_redraws_every_update_in_place():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    stream, now = Terminal(), [0.0]
    bar = ProgressBar(2150, desc="sft", stream=stream, clock=lambda: now[0])
    for step in range(1, 11):
        now[0] = step * 0.2
        bar.update(step)
    text = stream.getvalue()
    assert text.count("\r\x1b[2K") == 10 and "\n" not in text and text.endswith(bar.last_line)
    bar.close()
    assert stream.getvalue() == text + "\n"


def _traj(group, reward, calls, errors, answers, length, finish="no_tool_call"):
    t = Trajectory(prompt_ids=[1, 2], response_ids=list(range(length)), loss_mask=[1] * length,
                   sampler_logprobs=[0.0] * length, policy_versions=[0] * length, reward=reward,
                   finish_reason=finish, truncated=finish == "budget", group_id=group)
    t.n_tool_calls, t.n_tool_errors, t.n_answer_tags = calls, errors, answers
    return t


def test_rollout_stats_by_hand():
    trajectories = [
        # group 0: mixed (kept)
        _traj(0, 1.0, calls=2, errors=0, answers=1, length=10),
        _traj(0, 0.0, calls=4, errors=3, answers=0, length=30, finish="budget"),
        # group 1: all correct (dropped)
        _traj(1, 1.0, calls=1, errors=1, answers=1, length=20),
        _traj(1, 1.0, calls=0, errors=0, answers=2, length=12),
    ]
    trajectories.append(_traj(2, 0.0, calls=2, errors=1, answers=1, length=8))  # group 2: all wrong
    s = rollout_stats(trajectories)
    # The stored records of the same trajectories give the same figures.
    assert record_stats([trajectory_record(t, str) for t in trajectories]) == s
    assert s["reward_mean"] == pytest.approx(3 / 5) and s["pass_rate"] == pytest.approx(3 / 5)
    assert (s["num_trajectories"], s["num_groups"]) == (5, 3)
    assert s["group_solve_rate"] == pytest.approx(2 / 3)
    assert s["tool_calls_mean"] == pytest.approx(9 / 5)
    assert s["tool_calls_mean_positive"] == pytest.approx(3 / 3)
    assert s["tool_calls_mean_negative"] == pytest.approx(6 / 2)
    assert s["tool_error_rate"] == pytest.approx(5 / 9)
    assert s["tool_error_rate_positive"] == pytest.approx(1 / 3)
    assert s["tool_error_rate_negative"] == pytest.approx(4 / 6)
    assert s["positive_with_tool_error"] == pytest.approx(1 / 3)  # per trajectory: one of three correct
    assert s["format_violation_rate"] == pytest.approx(2 / 5)  # answers 0 and 2
    assert s["response_length_mean"] == pytest.approx(80 / 5) and s["response_length_max"] == 30
    assert s["truncation_ratio"] == pytest.approx(1 / 5)
    assert s["sampled_tokens"] == 80 and s["retractions"] == 0
    # A ratio without a denominator is absent, not 0.0: no call made, no positive trajectory.
    silent = rollout_stats([_traj(0, 0.0, calls=0, errors=0, answers=1, length=5),
                            _traj(0, 0.0, calls=2, errors=0, answers=1, length=5)])
    assert silent["tool_error_rate"] == 0.0 and silent["tool_error_rate_negative"] == 0.0
    assert "tool_error_rate_positive" not in silent and "tool_calls_mean_positive" not in silent
    no_calls = rollout_stats([_traj(0, 1.0, calls=0, errors=0, answers=1, length=5)])
    assert not {"tool_error_rate", "tool_error_rate_positive", "tool_error_rate_negative",
                "tool_calls_mean_negative"} & set(no_calls)
    assert no_calls["tool_calls_mean"] == 0.0 and no_calls["tool_calls_mean_positive"] == 0.0
    with pytest.raises(ValueError, match="no trajectories"):
        rollout_stats([])


def test_flops_formula_by_hand_and_against_the_model():
    from flax import nnx

    from rstar_jax.model.qwen3 import Qwen3, Qwen3Config

    cfg = Qwen3Config.tiny()  # vocab 320, d 64, mlp 128, 2 layers, 4 heads x 16, 2 kv heads
    # Per layer: q 64*64 + o 64*64 + k 64*32 + v 64*32 = 12288; MLP 3*64*128 = 24576.
    # N = 2 * 36864 + LM head 64*320 = 94208.
    assert qwen3_matmul_params(cfg) == 94208
    count = flops_per_token(cfg, seq_len=128)
    # 6N = 565248; attention 6 * L2 * H4 * hd16 * T128 = 98304.
    assert count.flops_per_token == 663552.0
    assert flops_per_token(cfg, 128, training=False).flops_per_token == 221184.0

    # Independently: every matmul weight of the real model (no norms, no input embedding).
    model = nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(0)))
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    sizes = {"/".join(map(str, path)): math.prod(v.get_value().shape) for path, v in flat}
    matmul = sum(n for name, n in sizes.items() if "norm" not in name and name != "embed")
    assert matmul == qwen3_matmul_params(cfg)

    out = throughput(tokens=1000, seconds=2.0, flops_per_token_value=663552.0, num_devices=2,
                     peak_flops_per_device=1e9)
    assert out["tokens_per_s"] == 500.0 and out["flops_per_s"] == 500.0 * 663552.0
    assert out["mfu"] == pytest.approx(500.0 * 663552.0 / 2e9)
