"""roundpipe.hf.Trainer under torchrun: its ranks are roundpipe's data-parallel ranks (gloo, on
this machine's CPU). Two ranks at a global batch of 8 (2 samples x 2 accumulated batches x 2
ranks) against one process at the same global batch (2 samples x 4 batches): the same per-step
losses, gradient norms, learning rates and final weights; the resume of a two-rank run in new
processes; the evaluation loss as transformers computes it over ranks. The runs are
tests/trainer_dp_worker.py's: the two-rank runs whose process is not the point with torchrun's
environment in the session's rank processes (conftest's ``rank_pool``), the resume and the
example in new processes under torchrun, the one-process runs in the test's own process."""

import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parent))
import trainer_dp_worker  # noqa: E402
from test_distributed import free_port, torchrun  # noqa: E402
from trainer_common import collate, step_losses, tiny_llama, token_dataset  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "trainer_dp_worker.py"

pytestmark = [
    pytest.mark.slow,
    # One worker builds two_ranks, once; the tests that run ranks in the session's rank
    # processes are also in conftest's rank_pool group, so this module's are a group of their own
    # (with its worker's own rank processes) beside the other rank_pool tests.
    pytest.mark.xdist_group("trainer_dp"),
    pytest.mark.skipif(
        not dist.is_available() or not dist.is_gloo_available(),
        reason="torch.distributed with gloo is needed",
    ),
]


def _torchrun(mode, output_dir, result, nproc=2):
    """Run the worker under torchrun; returns every rank's record and the stdout."""
    out = torchrun([WORKER, mode, output_dir, result], nproc)
    return [torch.load(f"{result}-rank{r}.pt", weights_only=False) for r in range(nproc)], out


def _ranks(pool, mode, output_dir, result, world=2):
    """Run the worker on ``world`` of the session's rank processes (``pool``, conftest's
    rank_pool) with torchrun's variables; returns every rank's record and every rank's
    output (stdout and stderr)."""
    log_dir = Path(f"{result}-logs")
    log_dir.mkdir()
    args = [mode, str(output_dir), str(result)]
    try:
        outcome = pool.run("trainer_dp_worker", args, world, log_dir, 300, free_port())
    except TimeoutError as exc:
        pytest.fail(str(exc))
    for rank, (code, output) in outcome.items():
        assert code == 0, f"rank {rank}:\n{output}"
    records = [torch.load(f"{result}-rank{r}.pt", weights_only=False) for r in range(world)]
    return records, [outcome[r][1] for r in range(world)]


def _logged(record, key):
    return [
        e[key]
        for e in record["log_history"]
        if key in e and "train_loss" not in e and "eval_loss" not in e
    ]


@pytest.fixture(scope="session")  # xdist may run other modules' tests between this one's
def two_ranks(tmp_path_factory, rank_pool):
    """The uninterrupted two-rank run (12 steps, a checkpoint at step 7), once per worker:
    its records, each rank's output, its output directory."""
    tmp = tmp_path_factory.mktemp("two-ranks")
    return (*_ranks(rank_pool, "full", tmp / "out", tmp / "result"), tmp / "out")


@pytest.mark.timeout(400)
def test_two_ranks_equal_one_process_at_the_same_global_batch(two_ranks, tmp_path):
    records, outputs, _ = two_ranks
    trainer_dp_worker.run("full", str(tmp_path / "out"), str(tmp_path / "result"))
    one = torch.load(f"{tmp_path / 'result'}-rank0.pt", weights_only=False)
    assert one["world"] == 1 and one["data_parallel"] is None
    assert [r["data_parallel"] for r in records] == [[0, 2], [1, 2]]

    # What each rank logs is the run's: the mean loss over the ranks, the global gradient norm.
    for rank in records:
        losses = step_losses(rank["log_history"])
        assert len(losses) == trainer_dp_worker.STEPS
        torch.testing.assert_close(
            torch.tensor(losses),
            torch.tensor(step_losses(one["log_history"])),
            rtol=1e-5,
            atol=1e-5,
        )
        for key in ("grad_norm", "learning_rate"):
            torch.testing.assert_close(
                torch.tensor(_logged(rank, key), dtype=torch.float64),
                torch.tensor(_logged(one, key), dtype=torch.float64),
                rtol=1e-5,
                atol=1e-7,
            )
    assert max(_logged(one, "grad_norm")) > 0.5  # max_grad_norm=0.5: the clipping was active

    # The same weights on both ranks, bit for bit, and those of one process within fp32 rounding.
    assert all(r["replicas_identical"] for r in records)
    for name, value in records[0]["masters"].items():
        assert torch.equal(records[1]["masters"][name], value), name
        torch.testing.assert_close(value, one["masters"][name], rtol=1e-5, atol=1e-6)

    # Rank 0 logs (transformers' printer callback prints each log once, not per rank).
    assert [r["is_world_process_zero"] for r in records] == [True, False]
    assert [out.count("'grad_norm'") for out in outputs] == [trainer_dp_worker.STEPS, 0], outputs
    # The Trainer's device placement and accelerate's prepare neither moved nor wrapped it.
    for rank in records:
        assert rank["model_type"] == "HFRoundPipe" and rank["wrapped_is_model"]
        assert rank["accelerate_models"] == ["HFRoundPipe"]  # no DistributedDataParallel
        assert rank["param_devices"] == ["cpu"]

    # The evaluation, as transformers computes it: one process averages its batches' mean
    # losses; over ranks each batch's loss is weighed by its share of every rank's tokens (the
    # token count gathered over the ranks), so the eval loss is the mean over all eval tokens.
    evals = token_dataset(n=8, seed=5)
    for record in (one, records[0]):
        model = tiny_llama()
        model.load_state_dict(record["masters"])
        sums, counts, means = [], [], []
        with torch.no_grad():
            for start in (0, 4):
                batch = collate(evals[start : start + 4])
                count = int((batch["labels"][:, 1:] != -100).sum())
                means.append(float(model(**batch).loss))
                sums.append(means[-1] * count)
                counts.append(count)
        want = sum(means) / 2 if record is one else sum(sums) / sum(counts)
        assert record["eval_loss"] == pytest.approx(want, rel=1e-5)
    assert records[1]["eval_loss"] == records[0]["eval_loss"]


@pytest.mark.timeout(400)
def test_fp16_over_two_ranks_skips_the_same_steps_as_one_process(tmp_path, rank_pool):
    # fp16 with roundpipe's GradScaler joined to the Trainer's DataParallel: the first steps
    # overflow on some rank, every rank skips them (one decision), and the scale, learning rate
    # and losses follow the one-process run at the same global batch.
    records, _ = _ranks(rank_pool, "fp16", tmp_path / "out2", tmp_path / "result2")
    trainer_dp_worker.run("fp16", str(tmp_path / "out1"), str(tmp_path / "result1"))
    one = torch.load(f"{tmp_path / 'result1'}-rank0.pt", weights_only=False)
    scales = _logged(one, "loss_scale")
    assert scales[-1] < 2.0**28 and len(set(scales)) > 1, scales  # it backed off from 2**28
    for rank in records:
        assert _logged(rank, "loss_scale") == scales
        assert _logged(rank, "learning_rate") == pytest.approx(_logged(one, "learning_rate"))
        torch.testing.assert_close(
            torch.tensor(step_losses(rank["log_history"])),
            torch.tensor(step_losses(one["log_history"])),
            rtol=1e-3,
            atol=1e-3,
        )
    assert all(r["replicas_identical"] for r in records)
    for name, value in records[0]["masters"].items():
        assert torch.equal(records[1]["masters"][name], value), name
        assert torch.isfinite(value).all()
        torch.testing.assert_close(value, one["masters"][name], rtol=1e-3, atol=1e-4)


@pytest.mark.timeout(400)
def test_a_two_rank_run_resumes_in_new_processes_as_if_uninterrupted(two_ranks, tmp_path):
    # The uninterrupted run's checkpoint of step 7, alone in a new output directory: a run cut
    # short there leaves the same (a run that stops right after its save, so that only the
    # wait for the write keeps it complete, is test_trainer's resume test).
    full, _, full_out = two_ranks
    out = tmp_path / "out"
    name = f"checkpoint-{trainer_dp_worker.STOP}"
    shutil.copytree(full_out / name, out / name)
    # rank 0 wrote it, with both ranks' RNG state and Trainer state
    assert sorted(p.name for p in (out / name).glob("rank-*")) == [
        "rank-00000.safetensors",
        "rank-00001.safetensors",
    ]
    resumed, _ = _torchrun("resume", out, tmp_path / "resume")
    for rank, record in enumerate(resumed):
        assert record["step"] == trainer_dp_worker.STEPS
        # the history holds the steps before the checkpoint too
        assert step_losses(record["log_history"]) == step_losses(full[rank]["log_history"])
        assert record["masters"].keys() == full[rank]["masters"].keys()
        for name, value in record["masters"].items():
            assert torch.equal(value, full[rank]["masters"][name]), (rank, name)


@pytest.mark.timeout(300)
def test_the_trainer_example_under_torchrun(tmp_path):
    out = torchrun(
        [ROOT / "examples" / "trainer_hf.py", "--steps", 4, "--layers", 1, "--hidden", 32]
        + ["--seq-len", 32, "--out", tmp_path / "out"]
    )
    assert "2 data-parallel ranks" in out, out
    assert out.count("train tokens/s") == 1  # rank 0 reports
    assert "reloaded in plain transformers" in out
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == ["checkpoint-4"]


@pytest.mark.timeout(400)
def test_sft_trainers_token_metrics_over_two_ranks_equal_one_process(tmp_path, rank_pool):
    """TRL averages each batch's entropy and accuracy, pooled over the ranks: two ranks of 2
    samples x 2 batches equal one process of 4 samples x 2 batches (the pooled batches)."""
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    records, _ = _ranks(rank_pool, "sft", tmp_path / "two", tmp_path / "two")
    trainer_dp_worker.run("sft", str(tmp_path / "one"), str(tmp_path / "one"))
    one = torch.load(f"{tmp_path / 'one'}-rank0.pt", weights_only=False)
    for key in ("loss", "grad_norm", "entropy", "mean_token_accuracy", "num_tokens"):
        want = _logged(one, key)
        assert len(want) == 6, key
        for rank in records:
            torch.testing.assert_close(
                torch.tensor(_logged(rank, key), dtype=torch.float64),
                torch.tensor(want, dtype=torch.float64),
                rtol=1e-5,
                atol=1e-6,
            )
    for name, value in one["masters"].items():
        torch.testing.assert_close(records[0]["masters"][name], value, rtol=1e-5, atol=1e-6)
    # The evaluation's: over two ranks TRL weighs the batches' tokens as one process does not
    # (see the eval loss above), so the same metrics, each equal on both ranks.
    for key in ("eval_loss", "eval_entropy", "eval_mean_token_accuracy"):
        assert records[0]["eval"][key] == records[1]["eval"][key], key
