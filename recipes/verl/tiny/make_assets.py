"""The tiny GRPO recipe's assets, made offline (no download): a 2-layer random Qwen2 with a byte-level
BPE tokenizer trained here, and train/test parquet files of addition questions in verl's format.

    python recipes/verl/tiny/make_assets.py OUT_DIR

writes OUT_DIR/model (config.json, model.safetensors, tokenizer files with a chat template),
OUT_DIR/train.parquet (24 rows) and OUT_DIR/test.parquet (8 rows). Deterministic: the same files
every time. Needs transformers, tokenizers, pandas and pyarrow (all in verl's environment).
"""

from __future__ import annotations

import argparse
import os
import random

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tokenizer(out: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [f"What is {a} + {b}? Let's think step by step. {a} + {b} = {a + b}. #### {a + b}"
              for a in range(25) for b in range(25)]
    corpus += ["user assistant system You are a helpful assistant."] * 8
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                 pad_token="<|endoftext|>")
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(out)
    return hf


def model(out: str, hf) -> int:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False, eos_token_id=hf.eos_token_id,
                      pad_token_id=hf.pad_token_id, bos_token_id=hf.eos_token_id,
                      torch_dtype="float32")
    torch.manual_seed(0)
    m = Qwen2ForCausalLM(cfg)
    m.save_pretrained(out)
    return sum(p.numel() for p in m.parameters())


def data(out_dir: str) -> None:
    import pandas as pd

    rng = random.Random(0)
    rows = []
    for i in range(32):
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        rows.append({"data_source": "fsdp_sync/tiny_addition",
                     "prompt": [{"role": "user",
                                 "content": f"What is {a} + {b}? Let's think step by step."}],
                     "ability": "math",
                     "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                     "extra_info": {"split": "train" if i < 24 else "test", "index": i}})
    pd.DataFrame(rows[:24]).to_parquet(os.path.join(out_dir, "train.parquet"))
    pd.DataFrame(rows[24:]).to_parquet(os.path.join(out_dir, "test.parquet"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", help="directory to write model/, train.parquet, test.parquet into")
    out_dir = ap.parse_args().out_dir
    os.makedirs(os.path.join(out_dir, "model"), exist_ok=True)
    hf = tokenizer(os.path.join(out_dir, "model"))
    n = model(os.path.join(out_dir, "model"), hf)
    data(out_dir)
    print(f"tiny recipe assets in {out_dir}: Qwen2 of {n} parameters, vocabulary {len(hf)}, "
          f"24 train and 8 test prompts")


if __name__ == "__main__":
    main()
