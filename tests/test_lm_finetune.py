"""The causal-LM recipe on a tiny Llama built here, launched as users launch it on CPU."""

import json
import math
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import BIN, LM_INTERRUPTED_ARGS, REPO, accelerate_cpu, error_lines, interrupt, lm_args, results, run
from common.text import IGNORE_INDEX, chat_example, load_raw_datasets, tokenize_and_pack

RECIPE = REPO / "recipes" / "lm_finetune.py"


def eval_loss(model_dir, lm, block_size=32, model=None):
    """Token-weighted loss of a saved model on the validation file, computed here, without Accelerate."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = model or AutoModelForCausalLM.from_pretrained(model_dir)
    raw = load_raw_datasets(train_file=lm["train"], validation_file=lm["validation"])
    blocks = tokenize_and_pack(raw, tokenizer, data_format="text", text_column="text", block_size=block_size)["validation"]
    total, tokens = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(blocks), 16):
            ids = blocks[i:i + 16]["input_ids"]
            logits = model(input_ids=ids).logits[:, :-1]
            total += torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="sum").item()
            tokens += ids[:, 1:].numel()
    return total / tokens


def test_two_processes_learn_and_from_pretrained_reproduces_the_eval_loss(tiny_lm, tmp_path):
    out = tmp_path / "run"
    run([REPO / "launch.sh", "lm_finetune", *lm_args(tiny_lm, out, "--num_train_epochs", "3")])
    res = results(out)
    assert res["world_size"] == 2 and res["effective_batch_size"] == 16 and res["block_size"] == 32
    before = eval_loss(tiny_lm["model"], tiny_lm)
    assert before > 2.5  # about ln(17): the untrained model guesses
    assert res["eval_loss"] < 0.5 * before, res
    assert res["perplexity"] == pytest.approx(math.exp(res["eval_loss"]))
    assert res["tokens_per_second"] > 0 and res["mfu"] is None  # no GPU peak to compare with on CPU
    # the steady rate is the same work less the first step (which pays one-time costs)
    assert res["steady_tokens_per_second"] == pytest.approx(res["steady_samples_per_second"] * 32)
    assert res["steady_tokens_per_second"] > res["tokens_per_second"] * (res["steps"] - 1) / res["steps"]
    assert eval_loss(out, tiny_lm) == pytest.approx(res["eval_loss"], rel=1e-4)


def test_one_process_learns_from_a_dataset_folder_with_gradient_checkpointing(tiny_lm, tmp_path):
    """--dataset_name takes what datasets.load_dataset takes: a hub id, or (here, offline) a folder
    whose files name the splits."""
    folder = tmp_path / "dataset"
    folder.mkdir()
    shutil.copy(tiny_lm["train"], folder / "train.jsonl")
    shutil.copy(tiny_lm["validation"], folder / "validation.jsonl")
    out = tmp_path / "run"
    args = [a for a in lm_args(tiny_lm, out, "--num_train_epochs", "2", "--gradient_checkpointing")
            if str(a) not in ("--train_file", "--validation_file", str(tiny_lm["train"]), str(tiny_lm["validation"]))]
    cmd, env = accelerate_cpu(1, RECIPE, *args, "--dataset_name", folder)
    run(cmd, env=env)
    res = results(out)
    assert res["world_size"] == 1 and res["eval_loss"] < 0.6 * eval_loss(tiny_lm["model"], tiny_lm)
    assert res["eval_loss"] == pytest.approx(eval_loss(out, tiny_lm), rel=1e-4)  # the same validation split


@pytest.mark.parametrize("suffix", [".txt", ".csv", ".parquet", ".jsonl"])
def test_local_files_of_every_format_load_with_a_held_out_split(tmp_path, suffix):
    import datasets

    lines = [f"line {i}" for i in range(40)]
    path = tmp_path / f"data{suffix}"
    if suffix == ".txt":
        path.write_text("\n".join(lines) + "\n")
    else:
        table = datasets.Dataset.from_dict({"text": lines})
        {".csv": table.to_csv, ".parquet": table.to_parquet, ".jsonl": table.to_json}[suffix](str(path))
    raw = load_raw_datasets(train_file=path, validation_split_percentage=10, seed=0)
    assert len(raw["train"]) == 36 and len(raw["validation"]) == 4
    assert sorted([*raw["train"]["text"], *raw["validation"]["text"]]) == sorted(lines)


def test_two_processes_with_batch_b_follow_one_process_with_batch_2b(tiny_lm, tmp_path):
    """Data parallelism is exact: the same samples per step, gradients averaged over the same
    tokens, so the loss curve matches step for step."""
    curves = {}
    for nproc, batch in ((1, 8), (2, 4)):
        out = tmp_path / f"{nproc}x{batch}"
        cmd, env = accelerate_cpu(nproc, RECIPE, *lm_args(tiny_lm, out, "--per_device_train_batch_size", str(batch),
                                                           "--max_train_steps", "12", "--logging_steps", "1"))
        run(cmd, env=env)
        res = results(out)
        assert res["world_size"] == nproc and res["effective_batch_size"] == 8
        curves[nproc] = [(h["step"], h["train_loss"]) for h in res["log_history"]]
    assert [s for s, _ in curves[1]] == list(range(1, 13))
    assert [s for s, _ in curves[1]] == [s for s, _ in curves[2]]
    for (step, one), (_, two) in zip(curves[1], curves[2]):
        assert two == pytest.approx(one, rel=2e-4, abs=1e-5), f"step {step}: {one} vs {two}"
    assert curves[1][-1][1] < 0.8 * curves[1][0][1]  # and it is a curve, not a flat line


def test_sigterm_mid_epoch_then_resume_gives_the_same_loss_and_weights(tiny_lm, lm_uninterrupted, tmp_path):
    """SIGTERM to every process of an `accelerate launch` job, as Slurm and Ctrl-C's neighbours send
    it: each process finishes the step, they save one checkpoint and exit 75. Resumed with
    `latest`, the loss curve and the weights are the uninterrupted run's."""
    args, straight, resumed = LM_INTERRUPTED_ARGS, lm_uninterrupted, tmp_path / "resumed"
    cmd, env = accelerate_cpu(2, RECIPE, *lm_args(tiny_lm, resumed, *args, "--checkpointing_steps", "4"))
    proc, _ = interrupt(cmd, env, resumed, after_step=4)
    assert proc.returncode != 0, proc.stderr[-3000:]
    stop = max(int(p.name.split("-")[1]) for p in resumed.glob("checkpoint-*"))
    assert 4 < stop < 14 and f"preempted: stopped by SIGTERM after step {stop}" in proc.stderr
    files = json.loads((resumed / f"checkpoint-{stop}" / "trainer_state.json").read_text())["files"]
    assert {"random_states_0.pkl", "random_states_1.pkl"} <= set(files)  # both processes stopped at this step
    cmd, env = accelerate_cpu(2, RECIPE, *lm_args(tiny_lm, resumed, *args, "--resume_from_checkpoint", "latest"))
    run(cmd, env=env)
    a, b = results(straight), results(resumed)
    assert a["steps"] == b["steps"] == 14 and a["epochs"] > 2  # the resumed part crossed epoch boundaries
    assert b["log_history"][0]["step"] == stop + 1
    for after, before in zip(b["log_history"], a["log_history"][stop:], strict=True):  # the same curve after the stop
        assert after["step"] == before["step"] and after["lr"] == pytest.approx(before["lr"])
        assert after["train_loss"] == pytest.approx(before["train_loss"], rel=1e-5)
    assert b["eval_loss"] == pytest.approx(a["eval_loss"], rel=1e-5)
    wa = AutoModelForCausalLM.from_pretrained(straight).state_dict()
    wb = AutoModelForCausalLM.from_pretrained(resumed).state_dict()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=1e-5, atol=1e-6, msg=name)


def test_chat_masks_everything_but_the_assistant_reply(tiny_lm):
    tokenizer = AutoTokenizer.from_pretrained(tiny_lm["model"])
    messages = [{"role": "user", "content": "count from one two three"},
                {"role": "assistant", "content": "four five"}]
    row = chat_example(tokenizer, messages)
    tokens = tokenizer.convert_ids_to_tokens(row["input_ids"])
    assert tokens == ["<|user|>", "count", "from", "one", "two", "three", "<|end|>",
                      "<|assistant|>", "four", "five", "<|end|>"]
    trained = [t for t, label in zip(tokens, row["labels"]) if label != IGNORE_INDEX]
    assert trained == ["four", "five", "<|end|>"]
    assert [label for label in row["labels"] if label != IGNORE_INDEX] == tokenizer.convert_tokens_to_ids(trained)


def test_chat_lora_run_saves_an_adapter_that_peft_loads(tiny_lm, tmp_path):
    from peft import PeftModel

    out = tmp_path / "run"
    run([REPO / "launch.sh", "lm_finetune", "--num_processes", "1", "--model_name_or_path", tiny_lm["model"],
         "--train_file", tiny_lm["chat"], "--data_format", "chat", "--output_dir", out, "--block_size", "32",
         "--per_device_train_batch_size", "4", "--learning_rate", "3e-3", "--lora_r", "8", "--max_train_steps", "10"])
    res = results(out)
    assert (out / "adapter_model.safetensors").is_file() and not (out / "model.safetensors").exists()
    base = AutoModelForCausalLM.from_pretrained(tiny_lm["model"])
    trainable = res["parameters"] - sum(p.numel() for p in base.parameters())
    assert trainable > 0
    model = PeftModel.from_pretrained(base, out)
    lora = {n: p for n, p in model.named_parameters() if "lora_B" in n}
    assert lora and any(p.abs().sum() > 0 for p in lora.values()), "lora_B starts at zero; training moved it"


@pytest.mark.parametrize("extra, message", [
    (["--text_column", "body"], "--text_column body: not in the data (columns: text)"),
    (["--block_size", "128"], "--block_size 128 is larger than the model accepts (64)"),
    (["--model_name_or_path", "/no/such/model"], "--model_name_or_path /no/such/model: no such folder"),
    (["--validation_file", "/no/such.jsonl"], "--validation_file /no/such.jsonl: no such file"),
])
def test_bad_input_gets_one_error_line(tiny_lm, tmp_path, extra, message):
    out = tmp_path / "run"
    # Input validation needs no launcher: one case goes through launch.sh, the rest straight to python.
    launcher = [REPO / "launch.sh", "lm_finetune", "--num_processes", "1"] if "--text_column" in extra else [BIN / "python", RECIPE]
    proc = run([*launcher, *lm_args(tiny_lm, out), *extra], check=False)
    assert proc.returncode != 0
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and message in lines[0], proc.stderr[-3000:]
    assert not out.exists()
