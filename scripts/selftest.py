"""./launch.sh selftest [--config NAME] [--num_processes N] [--mixed_precision no|bf16]: what the README promises,
checked on this machine under this accelerate config, in a few minutes, on a tiny LM and images made here, offline.
Run it on new hardware (a GPU node, a laptop) before a long job. Each check launches the recipes as a user does
(./launch.sh with that config), and prints a row: the property, the numbers measured, pass or FAIL; the exit code is
1 if any check failed.

    one big batch   N processes x batch b train the model 1 process x batch Nb trains (chat data, loss weighted by
                    target tokens): the weights' distance, relative to the update
    exact eval      every eval token counted once: the N-process run's count against 1 process's
    save reloads    the saved model, loaded with from_pretrained, gives the eval loss the run reported
    exact resume    stopped by SIGTERM after a checkpoint and resumed: the weights of the run never stopped
    images learn    (DDP configs) cifar.py on scikit-learn's digits in N processes: accuracy, each sample once; on
                    GPUs with --norm_layer sync_batch, channels_last and bf16 autocast, the paths a CPU cannot run
"""

import contextlib
import io
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from launcher import read_config  # noqa: E402
from make_digits import write_digits  # noqa: E402
from make_tiny_lm import write_tiny_lm  # noqa: E402

from common import mesh  # noqa: E402  (launcher put the repository on the path)
from common.args import ArgumentParser  # noqa: E402

TOLERANCE = {"no": 1e-4, "bf16": 5e-2, "fp16": 5e-2}  # a distance relative to the update itself


RUNNING: list = []  # the launches under way, stopped with this process


class Mistake(Exception):
    """A launch that ended with exit 2: the arguments or the environment are wrong for every check alike (fp16 on a
    CPU, a cache variable that is a file), so the selftest ends with that line instead of failing each check."""


def launch(launch_args, recipe, *args, wait=True, timeout=900):
    """./launch.sh RECIPE with the config's arguments, in a session of its own; waited for, in `timeout` seconds."""
    cmd = [str(ROOT / "launch.sh"), recipe, *launch_args, *map(str, args)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    RUNNING.append(proc)
    if not wait:
        return proc
    try:
        _, stderr = proc.communicate(timeout=timeout)
    finally:
        stop(proc)
    if proc.returncode == 2 and (said := [line for line in stderr.splitlines() if "error: " in line]):
        raise Mistake(said[-1])
    if proc.returncode:
        raise RuntimeError(f"{recipe} exited {proc.returncode}: {stderr.strip()[-600:]}")
    return proc


def stop(proc, sig=signal.SIGKILL) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        proc.wait(timeout=180)
    if proc in RUNNING:
        RUNNING.remove(proc)


def on_signal(signum, frame):
    """A stop: the launches under way stop too (they save what they were doing), and so does this."""
    for proc in list(RUNNING):
        stop(proc, signal.SIGTERM)
    sys.exit(128 + signum)


def results(folder) -> dict:
    return json.loads((Path(folder) / "results.json").read_text())


def distance(a, b, start) -> float:
    """|weights(a) - weights(b)| / |weights(b) - weights(start)|."""
    from safetensors.torch import load_file

    x, y, w0 = (load_file(Path(f) / "model.safetensors") for f in (a, b, start))
    apart = sum(((x[k].double() - y[k].double()) ** 2).sum() for k in y)
    update = sum(((y[k].double() - w0[k].double()) ** 2).sum() for k in y)
    return float((apart / update).sqrt())


def reloaded_eval_loss(folder, lm, chat=True, block_size=32, model=None) -> float:
    """The token-weighted eval loss of the model saved in `folder` (or `model`) on the validation blocks the recipe
    held out (10% of the varied chats split with the recipes' seed, or the text validation file), computed here,
    without Accelerate."""
    import datasets
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    datasets.disable_progress_bar()
    transformers.logging.disable_progress_bar()
    sys.path.insert(0, str(ROOT))
    from common.text import IGNORE_INDEX, load_raw_datasets, tokenize_and_pack

    tokenizer, model = AutoTokenizer.from_pretrained(folder), model or AutoModelForCausalLM.from_pretrained(folder)
    if chat:
        raw = load_raw_datasets(train_file=lm["chat_varied"], validation_split_percentage=10, seed=42)
    else:
        raw = load_raw_datasets(train_file=lm["train"], validation_file=lm["validation"])
    blocks = tokenize_and_pack(
        raw, tokenizer, data_format="chat" if chat else "text", text_column="text", block_size=block_size
    )["validation"]
    total, tokens = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(blocks), 16):
            ids, labels = blocks[i : i + 16]["input_ids"], blocks[i : i + 16]["labels"][:, 1:]
            logits = model(input_ids=ids).logits[:, :-1].float()
            total += torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="sum").item()
            tokens += int((labels != IGNORE_INDEX).sum())
    return total / tokens


def lm_args(lm, out, batch, *extra):
    chats = ["--train_file", lm["chat_varied"], "--data_format", "chat", "--validation_split_percentage", "10"]
    common = [
        "--model_name_or_path",
        lm["model"],
        "--output_dir",
        out,
        "--block_size",
        "32",
        "--learning_rate",
        "3e-3",
    ]
    common += ["--lr_scaling", "none", "--warmup_ratio", "0", "--max_grad_norm", "0", "--logging_steps", "1"]
    return [*common, *chats, "--per_device_train_batch_size", batch, "--dataloader_num_workers", "0", *extra]


def build_parser() -> ArgumentParser:
    p = ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", help="an accelerate_configs/ name (default: launch.sh's choice for this host)")
    p.add_argument("--num_processes", type="positive_int", help="processes on this node (default: the config's)")
    p.add_argument("--mixed_precision", choices=["no", "bf16", "fp16"])
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    ours = [*(["--config", args.config] if args.config else [])]
    ours += ["--num_processes", str(args.num_processes)] if args.num_processes else []
    ours += ["--mixed_precision", args.mixed_precision] if args.mixed_precision else []
    precision = args.mixed_precision or "no"
    dry = subprocess.run([str(ROOT / "launch.sh"), "lm_finetune", *ours, "--dry_run"], capture_output=True, text=True)
    if dry.returncode:
        print(dry.stderr.strip(), file=sys.stderr)
        return dry.returncode
    command = dry.stderr.strip().splitlines()[-1]
    config = command.split("--config_file ")[1].split()[0]
    nproc = int(command.split("--num_processes ")[1].split()[0]) if "--num_processes " in command else 0
    _, config_nproc, kind, use_cpu, _ = read_config(Path(config))
    nproc = nproc or config_nproc
    deepspeed_or_fsdp = kind in ("DEEPSPEED", "FSDP")
    sizes = {d: int(v) for d, v in re.findall(r"--parallelism_config_(\w+?)_size (\d+)", command)}  # launch.sh's mesh
    data_parallel = mesh.data_parallel_size(sizes) if sizes else nproc  # tensor-parallel ranks share a batch
    print(f"selftest: {config}, {nproc} process(es), --mixed_precision {precision}")
    rows, tol = [], TOLERANCE[precision]

    def check(name, fn):
        tic = time.monotonic()
        try:
            ok, said = fn()
        except Mistake:
            raise
        except Exception as err:  # a check that could not run is a failure, with its reason
            ok, said = False, f"{type(err).__name__}: {str(err).strip().splitlines()[-1] if str(err).strip() else ''}"
        rows.append((name, "pass" if ok else "FAIL", said, time.monotonic() - tic))
        print(f"  {name:<14} {'pass' if ok else 'FAIL':<5} {said} ({rows[-1][3]:.0f} s)", flush=True)

    import transformers

    transformers.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="selftest-") as tmp:
        tmp = Path(tmp)
        with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed, imported on the way, says which device it found
            lm = write_tiny_lm(tmp / "lm")
        one, many = tmp / "one", tmp / "many"
        # one process of the same strategy: a mesh's config needs several, and FSDP2 on one process is its 1 x 1
        alone = "fsdp" if sizes else args.config
        single = [*(["--config", alone] if alone else []), "--num_processes", "1"]
        single += ["--mixed_precision", args.mixed_precision] if args.mixed_precision else []

        # One N-process run serves three checks: the big batch's, whose eval and save the next two read, and the
        # uninterrupted reference of the resume check (whose stopped run saves a checkpoint every 4 steps: 60 steps
        # leave its stop time to land mid-run, after checkpoint-4, on a fast GPU too).
        steps = ["--max_train_steps", "60"]

        def big_batch():
            launch(single, "lm_finetune", *lm_args(lm, one, 2 * data_parallel, *steps))
            launch(ours, "lm_finetune", *lm_args(lm, many, 2, *steps))
            d = distance(many, one, lm["model"])
            return d < tol, f"distance {d:.1e} of the update (below {tol:g})"

        def exact_eval():
            a, b = results(one)["eval_tokens"], results(many)["eval_tokens"]
            return a == b, f"{b} eval tokens in {nproc} process(es), {a} in 1"

        def reloads():
            reported, reloaded = results(many)["eval_loss"], reloaded_eval_loss(many, lm)
            return math.isclose(
                reported, reloaded, rel_tol=max(1e-4, tol)
            ), f"eval loss {reported:.5f} reported, {reloaded:.5f} reloaded"

        def resume():
            straight, stopped = many, tmp / "stopped"  # the big batch's N-process run, never stopped
            if not (straight / "model.safetensors").exists():
                raise RuntimeError("the uninterrupted run (the big batch check's) did not finish")
            steps_saved = [*steps, "--checkpointing_steps", "4"]
            proc = launch(ours, "lm_finetune", *lm_args(lm, stopped, 2, *steps_saved), wait=False)
            deadline = time.monotonic() + 600
            while not (stopped / "checkpoint-4" / "trainer_state.json").exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the run to stop ended or stalled: {proc.stderr.read()[-600:] if proc.stderr else ''}"
                    )
                time.sleep(0.01)
            os.killpg(proc.pid, signal.SIGTERM)
            code = proc.wait(timeout=600)
            stop(proc)
            if code != 75:
                return False, f"stopped with exit {code}, not 75"
            launch(ours, "lm_finetune", *lm_args(lm, stopped, 2, *steps_saved, "--resume_from_checkpoint", "latest"))
            d = distance(stopped, straight, lm["model"])
            return d < tol / 10, f"distance {d:.1e} of the update (below {tol / 10:g}), exit 75 then resumed"

        def images():
            digits = tmp / "digits"
            n_train, n_val = write_digits(digits)
            out = tmp / "cifar"
            data = ["--dataset", "imagefolder", "--train_dir", digits / "train", "--val_dir", digits / "val"]
            model = ["--model", "resnet18", "--per_device_train_batch_size", "32", "--num_train_epochs", "3"]
            model += [] if use_cpu else ["--norm_layer", "sync_batch"]  # GPU-only; channels_last and bf16 are on
            launch(ours, "cifar", *data, *model, "--hflip", "0", "--output_dir", out)  # the default input path
            res = results(out)
            ok = res["eval_samples"] == n_val and res["eval_accuracy"] > 0.5
            path = "held on the device" if res["args"]["data_on_device"] else "DataLoader workers"
            from common.metrics import INPUT_BOUND  # the recipes' own line for an input-bound run

            share = res.get("data_wait_share") or 0.0  # of the median rank's step, spent waiting for its batch
            bound = "input-bound: the loader" if share > INPUT_BOUND else "compute-bound: the model"
            return (
                ok,
                f"accuracy {res['eval_accuracy']:.3f} (chance 0.1), {res['eval_samples']} of {n_val} eval samples; "
                f"input {path}, {share:.0%} of each step waiting for it: {bound} sets the pace",
            )

        checks = [("one big batch", big_batch), ("exact eval", exact_eval), ("save reloads", reloads)]
        checks += [("exact resume", resume)] + ([] if deepspeed_or_fsdp or sizes else [("images learn", images)])
        try:  # images: DDP's property (the image recipe's BatchNorm is per process; it has no layers to split)
            for name, fn in checks:
                check(name, fn)
        except Mistake as mistake:
            print(mistake, file=sys.stderr)
            return 2
    failed = [name for name, status, _, _ in rows if status == "FAIL"]
    print(
        f"selftest: {len(rows) - len(failed)} of {len(rows)} passed"
        + (f"; FAILED: {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(sig, on_signal)
    sys.exit(main())
