"""What every launcher shares: model and tokenizer loading, checkpoints, the train/eval run."""
from __future__ import annotations

import logging
import math
import os

from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.trainer_utils import get_last_checkpoint

from trajforge.training.data import load_release, train_eval_split

logger = logging.getLogger(__name__)


def load_tokenizer(model_args, training_args):
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path, revision=model_args.model_revision,
                                              trust_remote_code=training_args.trust_remote_code)
    chat_template_path = getattr(training_args, "chat_template_path", None)
    if chat_template_path:
        with open(chat_template_path) as f:
            tokenizer.chat_template = f.read()
    if tokenizer.chat_template is None:
        raise ValueError(f"{model_args.model_name_or_path} has no chat template; set chat_template_path")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(model_args, training_args, auto_class=AutoModelForCausalLM, **kwargs):
    """The model to train; `auto_class` and `kwargs` give a reward model's head (num_labels)."""
    dtype = model_args.dtype if model_args.dtype in (None, "auto") else getattr(__import__("torch"), model_args.dtype)
    return auto_class.from_pretrained(
        model_args.model_name_or_path, revision=model_args.model_revision, dtype=dtype,
        attn_implementation=model_args.attn_implementation, trust_remote_code=training_args.trust_remote_code,
        **kwargs)


def load_splits(data_args, default_config: str, seed: int):
    data = load_release(data_args.dataset_name, data_args.dataset_config or default_config,
                        data_args.dataset_revision)
    train, evaluation = train_eval_split(data, data_args.dataset_train_split, data_args.dataset_test_split,
                                         data_args.eval_fraction, seed)
    if data_args.max_train_samples is not None:
        train = train.select(range(min(data_args.max_train_samples, len(train))))
    return train, evaluation


def resume_checkpoint(training_args) -> str | None:
    """`resume_from_checkpoint`: a checkpoint folder, or `last` for the newest one in output_dir."""
    wanted = training_args.resume_from_checkpoint
    if wanted != "last":
        return wanted
    last = get_last_checkpoint(training_args.output_dir) if os.path.isdir(training_args.output_dir) else None
    if last is None:
        logger.warning("resume_from_checkpoint=last but no checkpoint in %s: starting fresh", training_args.output_dir)
    return last


def run(trainer, training_args) -> dict:
    """Train (resuming if asked), save the final model, evaluate when there is an eval set."""
    result = trainer.train(resume_from_checkpoint=resume_checkpoint(training_args))
    metrics = dict(result.metrics)
    trainer.log_metrics("train", metrics)
    trainer.save_metrics("train", metrics)
    trainer.save_state()
    trainer.save_model(training_args.output_dir)
    if trainer.eval_dataset is not None:
        eval_metrics = trainer.evaluate()
        trainer.log_metrics("eval", eval_metrics)
        trainer.save_metrics("eval", eval_metrics)
        metrics.update(eval_metrics)
    if not math.isfinite(metrics.get("train_loss", 0.0)):
        raise FloatingPointError(f"training loss is not finite: {metrics['train_loss']}")
    return metrics
