"""A tiny randomly initialised Qwen2 model and a BPE tokenizer trained on the fixture texts.

The trainers' tests need a real model and a real tokenizer without any download: the tokenizer
is trained here with the `tokenizers` library on the build's own conversations, wrapped in a
`PreTrainedTokenizerFast` with a ChatML chat template (the template family of Qwen2.5), and saved
with the model so that `from_pretrained(path)` works like for a Hub model.

Run `python tests/support/tiny_model.py OUT_DIR [BUILD_DIR]` to make one for the CLI smoke run.
"""
from __future__ import annotations

import glob
import sys
from pathlib import Path

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# A second template family: plain-text headers, a default system prompt when there is none,
# and a different end-of-turn text; the masks must follow whatever the template renders.
HEADERS = (
    "{% if messages[0]['role'] != 'system' %}### System:\nYou are an agent.\n\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}### Assistant:\n{{ m['content'] }}<|endoftext|>\n\n"
    "{% else %}### {{ m['role'] | capitalize }}:\n{{ m['content'] }}\n\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}### Assistant:\n{% endif %}"
)
END_OF_TURN = {CHATML: "<|im_end|>\n", HEADERS: "<|endoftext|>\n\n"}
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# The shipped trainer configs; each trainer has a `<trainer>_tiny.yaml` sized for the tiny model on CPU.
CONFIGS = Path(__file__).resolve().parents[2] / "training" / "configs"


def fixture_texts(build_dir: Path) -> list[str]:
    """Every turn of the build's SFT records: the tokenizer learns the words it will see."""
    import pyarrow.parquet as pq

    texts = []
    for path in sorted(glob.glob(str(build_dir / "data" / "sft" / "*.parquet"))):
        for conversation in pq.read_table(path, columns=["conversations"]).column(0).to_pylist():
            texts.extend(turn["content"] for turn in conversation)
    if not texts:
        raise FileNotFoundError(f"no SFT shards under {build_dir}/data/sft")
    return texts


def tool_chat_template() -> str:
    """Qwen2.5's own chat template (TRL's copy), which renders tools and tool calls: TRL recognises
    it and parses `<tool_call>` replies of a model that uses it."""
    from trl.chat_template_utils import qwen2_5_chat_template

    return qwen2_5_chat_template


def build_tokenizer(texts: list[str], vocab_size: int = 1024, chat_template: str = CHATML):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    # Byte-level BPE: decoding gives back the exact text, which the label-mask test relies on.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=chat_template)


def build_tiny_model(out: Path, build_dir: Path, seed: int = 0, chat_template: str = CHATML) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer(fixture_texts(build_dir), chat_template=chat_template)
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384,
                         bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


if __name__ == "__main__":
    print(build_tiny_model(Path(sys.argv[1]), Path(sys.argv[2] if len(sys.argv) > 2 else "build")))


def read_config(build_dir: Path, config: str) -> list[dict]:
    """Every row of one config of a build folder, in shard order."""
    import pyarrow.parquet as pq

    return [r for path in sorted(glob.glob(str(build_dir / "data" / config / "*.parquet")))
            for r in pq.read_table(path).to_pylist()]


def warm_start(model_dir: Path, build_dir: Path, out: Path, steps: int = 60, rows: int = 1000) -> Path:
    """The tiny model after a few steps of next-token fitting on the builds' first replies.

    GRPO learns only from reward differences inside a group. A random policy never writes an
    action marker, so every reward ties, every advantage is zero and no weight moves; a policy
    that has seen the reply formats sometimes writes them, as a real SFT-then-GRPO run does.
    """
    replies = []
    for row in read_config(build_dir, "sft")[:rows]:
        first = next(t for t in row["conversations"] if t["role"] == "assistant" and t["loss"])
        replies.append(f"<|im_start|>assistant\n{first['content']}<|im_end|>")
    return fit_texts(model_dir, replies, out, steps)


def fit_texts(model_dir: Path, texts: list[str], out: Path, steps: int, max_length: int = 64,
              contexts: list[str] | None = None, lr: float = 1e-2) -> Path:
    """The model after `steps` full-batch steps of next-token fitting on `texts`, each after its
    context (`contexts`, not trained on) when given."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    contexts = contexts or [""] * len(texts)
    batch = tokenizer([c + t for c, t in zip(contexts, texts)], add_special_tokens=False, padding=True,
                      truncation=True, max_length=max_length, return_tensors="pt")
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    for row, context in enumerate(contexts):
        labels[row, :len(tokenizer(context, add_special_tokens=False)["input_ids"])] = -100
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(steps):
        model(**batch, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def launch(trainer: str, tiny: Path, build: Path, out: Path, *overrides: str) -> None:
    """`trajforge train TRAINER` as a user runs it: its tiny config, the tiny model, a build, overrides."""
    from trajforge.flows.cli import main

    assert main(["train", trainer, "--config", str(CONFIGS / f"{trainer}_tiny.yaml"),
                 "--model_name_or_path", str(tiny), "--dataset_name", str(build),
                 "--output_dir", str(out), *overrides]) == 0


def labelled_runs(tokenizer, labels: list[int]) -> list[str]:
    """Decode each maximal run of trained tokens on its own."""
    from trajforge.training.data import IGNORE

    runs, current = [], []
    for label in labels + [IGNORE]:
        if label != IGNORE:
            current.append(label)
        elif current:
            runs.append(tokenizer.decode(current, skip_special_tokens=False))
            current = []
    return runs
