"""A tiny causal LM and learnable text to train it on, made here, offline: a 2-layer Llama with a word-level tokenizer
and a chat template, saved as a hub model folder is, and counting sequences in words ("three four five ...") as
jsonl, plus chats whose assistant continues the user's count. The tests and `./launch.sh selftest` use it.

    python scripts/make_tiny_lm.py data/tiny_lm
"""

import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.args import ArgumentParser  # noqa: E402

NUMBERS = "zero one two three four five six seven eight nine".split()


def write_tiny_lm(root) -> dict:
    """The model folder and the data files under `root`: {"model", "train", "validation", "chat", "chat_varied"}."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    root = Path(root)
    words = ["<unk>", "<eos>", "<|user|>", "<|assistant|>", "<|end|>", "count", "from", *NUMBERS]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>", model_max_length=64
    )
    tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m.role }}|> {{ m.content }} <|end|> {% endfor %}"
        "{% if add_generation_prompt %}<|assistant|> {% endif %}"
    )
    tokenizer.save_pretrained(root / "model")
    config = LlamaConfig(
        vocab_size=len(words), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, eos_token_id=1, bos_token_id=None, pad_token_id=None,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(root / "model")

    rng = random.Random(0)

    def count(n):
        start = rng.randrange(10)
        return " ".join(NUMBERS[(start + i) % 10] for i in range(n))

    for name, lines in (("train", 600), ("validation", 61)):
        with open(root / f"{name}.jsonl", "w") as f:
            for _ in range(lines):
                f.write(json.dumps({"text": count(rng.randrange(6, 14))}) + "\n")
    # chat_varied: replies of 1 to 24 words, so that blocks hold from a few to most of their tokens as targets
    for name, replies in (("chat", [5] * 300), ("chat_varied", [rng.randrange(1, 25) for _ in range(200)])):
        with open(root / f"{name}.jsonl", "w") as f:
            for reply in replies:
                said = count(3 + reply).split()
                messages = [
                    {"role": "user", "content": "count from " + " ".join(said[:3])},
                    {"role": "assistant", "content": " ".join(said[3:])},
                ]
                f.write(json.dumps({"messages": messages}) + "\n")
    names = ("train", "validation", "chat", "chat_varied")
    return {"model": root / "model", **{name: root / f"{name}.jsonl" for name in names}}


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("root", nargs="?", default="data/tiny_lm", help="output folder")
    return parser


if __name__ == "__main__":
    print(write_tiny_lm(build_parser().parse_args().root)["model"])
