"""`ember profile` of a SmolLM2-135M-shaped model on a lent GPU, for the simulator's hardware question.

The 98 MB SmolLM2 GGUF cannot travel to the lent machine, and a profile measures speed, which depends on
the model's shapes, not on its weights: so this builds a Llama with SmolLM2-135M's exact configuration and
random weights there (transformers), with SmolLM2's tokenizer (carried), and profiles it with the same
`profile_model` as `ember profile`. Writes the profile JSON.

    python benchmarks/device/gpu_profile.py --tokenizer DIR --out profile.json [--cost-per-replica-hour P]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import torch

from ember.control.autoscaling.profiler import profile_model

SMOLLM2_135M_CONFIG = dict(
    hidden_size=576,
    num_hidden_layers=30,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    vocab_size=49152,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)


def build_model_dir(path: Path, tokenizer_dir: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M_CONFIG)).to(torch.bfloat16).save_pretrained(path)
    for file in tokenizer_dir.iterdir():
        shutil.copy(file, path / file.name)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, required=True, help="SmolLM2's tokenizer folder")
    parser.add_argument("--out", type=Path, required=True, help="profile JSON to write")
    parser.add_argument("--cost-per-replica-hour", type=float, default=None, help="the GPU's price")
    parser.add_argument("--prompt-lengths", default="128,512,2048", help="comma-separated")
    parser.add_argument(
        "--batch-sizes", default="1,16,64,128,256", help="comma-separated; the largest is max_batch"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        model = build_model_dir(Path(folder), args.tokenizer)
        profile = profile_model(
            str(model),
            [int(n) for n in args.prompt_lengths.split(",")],
            [int(n) for n in args.batch_sizes.split(",")],
            decode_tokens=32,
            cost_per_replica_hour=args.cost_per_replica_hour,
            dtype="bfloat16",
            kv_cache_memory=16.0,
        )
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    profile = profile.model_copy(update={"model": f"SmolLM2-135M-shaped, bfloat16, {device}"})
    args.out.write_text(profile.model_dump_json(indent=2) + "\n", encoding="utf-8")
    print(profile.model_dump_json(indent=2))


if __name__ == "__main__":
    main()
