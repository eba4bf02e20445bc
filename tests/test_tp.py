"""Tensor parallelism through accelerate_configs/tp.yaml: one real 2-process launch over gloo, the way users launch
on a host without GPUs (`./launch.sh lm_finetune --config tp`, which runs `accelerate launch --config_file
accelerate_configs/tp.yaml`), against the one-process run of the same batch; the refusals in-process, as a launch
under tp.yaml meets them."""

from types import SimpleNamespace

import pytest
from conftest import (
    REPO,
    card,
    chat_args,
    cpu_env,
    eval_loss,
    results,
    run,
    samples,
    update_distance,
)


@pytest.mark.slow
def test_tp_in_two_processes_trains_what_one_process_trains_and_saves_a_loadable_model(
    tiny_lm, chat_reference, tmp_path
):
    """Both processes hold half of each split layer and see the same batch of 4 (a TP group is one data-parallel
    rank): every step's loss is the one process's, and so are the weights, the eval loss over the same tokens and
    the greedy samples; the save is whole (gathered from the split weights), from_pretrained loads it in one process
    and it gives the eval loss the run reported. Measured: losses equal to 2.4e-7, weights 6.9e-6 apart relative to
    the update (AdamW divides by the root of tiny second moments, which magnifies the split sums' rounding)."""
    out = tmp_path / "tp"
    run([REPO / "launch.sh", "lm_finetune", "--config", "tp", *chat_args(tiny_lm, out, 4)], env=cpu_env())
    res, reference = results(out), results(chat_reference)
    assert "./launch.sh lm_finetune --config tp --num_processes 2 " in card(out)[1]  # how to run it again
    assert res["world_size"] == 2 and res["effective_batch_size"] == reference["effective_batch_size"] == 4
    losses = [row["train_loss"] for row in res["log_history"]]
    assert losses == pytest.approx([row["train_loss"] for row in reference["log_history"]], rel=1e-6)
    assert len(losses) == 6
    assert max(res["parameters_per_process"]) < 0.55 * res["parameters"]  # each layer split, not copied
    assert update_distance(out, chat_reference, tiny_lm["model"]) < 2e-5
    assert res["eval_tokens"] == reference["eval_tokens"]  # every held-out token once, not once per process
    assert res["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-6)
    assert eval_loss(out, tiny_lm, chat=True) == pytest.approx(res["eval_loss"], rel=1e-6)
    assert samples(out) == samples(chat_reference)


def under_tp(monkeypatch, degree):
    """The variables accelerate launch sets from tp.yaml's parallelism_config."""
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", str(degree))


@pytest.mark.parametrize(
    "degree, named",
    [(3, "its 4 attention heads (num_attention_heads) do not divide into tensor-parallel degree 3; set "
          "parallelism_config_tp_size and --num_processes to 2"),
     (4, "its 2 key value heads (num_key_value_heads) do not divide into tensor-parallel degree 4; set "
         "parallelism_config_tp_size and --num_processes to 2")],
)  # fmt: skip
def test_a_degree_that_does_not_divide_the_heads_is_refused_before_the_model_loads(
    tiny_lm, monkeypatch, degree, named
):
    """The tiny Llama has 4 attention heads and 2 key-value heads: 3 splits neither, 4 the first only. The line
    names the model, the count and the degrees that fit (load_causal_lm asks before from_pretrained)."""
    from transformers import AutoConfig

    from common.runtime import RecipeError
    from common.tensor_parallel import load_kwargs

    under_tp(monkeypatch, degree)
    with pytest.raises(RecipeError) as refused:
        load_kwargs(AutoConfig.from_pretrained(tiny_lm["model"]), tiny_lm["model"])
    assert str(refused.value) == f"--model_name_or_path {tiny_lm['model']}: {named}, or use fsdp.yaml"


def test_a_model_without_a_tp_plan_is_refused(monkeypatch):
    from transformers import GPT2Config

    from common.runtime import RecipeError
    from common.tensor_parallel import load_kwargs

    assert load_kwargs(GPT2Config(), "gpt2") == {}  # without tp.yaml nothing changes
    under_tp(monkeypatch, 2)
    with pytest.raises(RecipeError, match=r"^--model_name_or_path gpt2: GPT2Config has no tensor-parallel plan "):
        load_kwargs(GPT2Config(), "gpt2")


def test_what_tp_cannot_do_here_is_refused_in_one_line(monkeypatch):
    """A degree below the process count (the 2-D case), checkpoints (none can be saved), a new model from a config
    (nothing to split as it loads), a LoRA adapter (peft's layers fail on the split shapes), a degree that is no
    number."""
    from common import tensor_parallel
    from common.runtime import RecipeError

    plain = SimpleNamespace(checkpointing_steps=None, resume_from_checkpoint=None, model_name_or_path="m")
    tensor_parallel.refuse_what_cannot_split(plain, SimpleNamespace(num_processes=4))  # no TP: nothing to refuse
    under_tp(monkeypatch, 2)
    assert tensor_parallel.data_parallel_size(SimpleNamespace(num_processes=2)) == 1
    tensor_parallel.refuse_what_cannot_split(plain, SimpleNamespace(num_processes=2))
    but = lambda **change: SimpleNamespace(**{**vars(plain), **change})  # noqa: E731
    cases = [
        (4, plain, "degree 2 in 4 processes"),
        (2, but(checkpointing_steps=10), "--checkpointing_steps under tensor parallelism"),
        (2, but(resume_from_checkpoint="latest"), "--resume_from_checkpoint under tensor parallelism"),
        (2, but(model_name_or_path=None, config_name="c"), "--config_name under tensor parallelism"),
        (2, but(lora_r=16), "--lora_r under tensor parallelism"),
    ]
    for processes, args, named in cases:
        with pytest.raises(RecipeError, match=named) as refused:
            tensor_parallel.refuse_what_cannot_split(args, SimpleNamespace(num_processes=processes))
        assert "\n" not in str(refused.value)
    with pytest.raises(RecipeError, match="a checkpoint was due"):
        tensor_parallel.refuse_checkpoint()
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "two")
    with pytest.raises(RecipeError, match="parallelism_config sizes must be whole numbers"):
        tensor_parallel.degree()
