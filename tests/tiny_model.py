"""A tiny randomly initialised Qwen2 model and a BPE tokenizer trained on the fixture texts.

The trainers' tests need a real model and a real tokenizer without any download: the tokenizer
is trained here with the `tokenizers` library on the build's own conversations, wrapped in a
`PreTrainedTokenizerFast` with a ChatML chat template (the template family of Qwen2.5), and saved
with the model so that `from_pretrained(path)` works like for a Hub model.

Run `python tests/tiny_model.py OUT_DIR [BUILD_DIR]` to make one for the CLI smoke run.
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
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


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


def build_tokenizer(texts: list[str], vocab_size: int = 1024):
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
                                   chat_template=CHATML)


def build_tiny_model(out: Path, build_dir: Path, seed: int = 0) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer(fixture_texts(build_dir))
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


# --- stand-ins for the `grpo` and `preference` release configs ------------------------------
# Used only while the build does not write those configs yet: derived from the real `sft` rows
# with the columns the release will carry, and written in the same layout, so the launchers
# read them exactly as they will read the real ones.

def first_action_turn(conversations: list[dict]) -> int | None:
    return next((i for i, t in enumerate(conversations)
                 if t["role"] == "assistant" and t["loss"] and t["action"] is not None), None)


def standin_grpo_rows(sft_rows: list[dict]) -> list[dict]:
    """Prompt = messages up to the first trained action turn; that turn's dialect is the format."""
    rows = []
    for row in sft_rows:
        k = first_action_turn(row["conversations"])
        if k is None:
            continue
        rows.append({"id": row["id"], "prompt": [{"role": t["role"], "content": t["content"]}
                                                for t in row["conversations"][:k]],
                     "answer": row["answer"], "env": row["env"], "domain": row["domain"], "task": row["task"],
                     "rendering": row["rendering"], "dialect": row["conversations"][k]["dialect"]})
    return rows


def standin_preference_rows(sft_rows: list[dict]) -> list[dict]:
    """Chosen = the first trained action turn; rejected = the trajectory's next action (a step
    taken out of order), a simple negative that is still in the env's own format."""
    rows = []
    for row in sft_rows:
        turns = row["conversations"]
        actions = [i for i, t in enumerate(turns) if t["role"] == "assistant" and t["loss"] and t["action"]]
        if len(actions) < 2 or turns[actions[0]]["content"] == turns[actions[1]]["content"]:
            continue
        k = actions[0]
        rows.append({"id": row["id"],
                     "prompt": [{"role": t["role"], "content": t["content"]} for t in turns[:k]],
                     "chosen": [{"role": "assistant", "content": turns[k]["content"]}],
                     "rejected": [{"role": "assistant", "content": turns[actions[1]]["content"]}]})
    return rows


def read_config(build_dir: Path, config: str) -> list[dict]:
    import pyarrow.parquet as pq

    return [r for path in sorted(glob.glob(str(build_dir / "data" / config / "*.parquet")))
            for r in pq.read_table(path).to_pylist()]


def ensure_training_configs(build_dir: Path, out: Path) -> Path:
    """A build folder with `sft`, `grpo` and `preference` configs: the real ones where the build
    wrote them, stand-ins derived from `sft` otherwise."""
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    shutil.copytree(build_dir / "data" / "sft", out / "data" / "sft", dirs_exist_ok=True)
    sft = read_config(build_dir, "sft")
    for config, derive in (("grpo", standin_grpo_rows), ("preference", standin_preference_rows)):
        if glob.glob(str(build_dir / "data" / config / "*.parquet")):
            shutil.copytree(build_dir / "data" / config, out / "data" / config, dirs_exist_ok=True)
        else:
            (out / "data" / config).mkdir(parents=True, exist_ok=True)
            pq.write_table(pa.Table.from_pylist(derive(sft)), out / "data" / config / "train-00000-of-00001.parquet")
    return out
