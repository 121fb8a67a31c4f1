"""Write a model ember can load (e.g. the default SmolLM2 GGUF) as a Hugging Face folder for peers
that need one (vLLM): safetensors + config.json + tokenizer.json + tokenizer_config.json.

    .venv/bin/python benchmarks/serving/export_hf_folder.py /tmp/peers/smollm2-hf [--model M] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ember.bench.offline import hf_model_from
from ember.loader import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    loaded = load_model(args.model, dtype=args.dtype)
    tokenizer = loaded.tokenizer
    hf_model_from(loaded).save_pretrained(args.out)
    # Older transformers (as in vLLM's environment) read rope_theta at the top level.
    config_path = args.out / "config.json"
    config = json.loads(config_path.read_text())
    config.setdefault("rope_theta", loaded.config.rope_theta)
    config_path.write_text(json.dumps(config, indent=1))
    tokenizer.hf_tokenizer.save(str(args.out / "tokenizer.json"))
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": tokenizer.chat_template,
                        "model_max_length": loaded.config.max_position_embeddings, **tokenizer.special_tokens}
    (args.out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
