"""Train a Hugging Face Llama with paratrain's Python API, in your own loop.

    python examples/train_llama.py --model path/to/llama_dir --nproc 4 --tp 2 --dp 2

``--make-tiny DIR`` first writes a tiny random Llama there with transformers (nothing is
downloaded), so the example runs anywhere:

    python examples/train_llama.py --make-tiny /tmp/tiny-llama --nproc 2 --tp 2 --steps 5

The data is paratrain's bundled byte-level corpus (its token ids fit any vocabulary of
at least 256). Every rank runs ``worker``; ``paratrain.api.spawn`` starts them here, and
under torchrun you would call ``worker`` after ``torch.distributed.init_process_group``.
"""

from __future__ import annotations

import argparse
import json

import torch.distributed as dist

from paratrain import api
from paratrain.layout import DP
from paratrain.train import data as D


def make_tiny_llama(directory: str) -> None:
    """A 2-layer Llama with grouped KV heads, random weights, saved as safetensors."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                      max_position_embeddings=128, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)


def worker(args: argparse.Namespace) -> list[float]:
    cfg = api.config(model=args.model, nproc=args.nproc, tp=args.tp, dp=args.dp, pp=args.pp,
                     zero=args.zero, seq_len=64, global_batch=8, micro_batch=2, steps=args.steps,
                     lr=1e-3, warmup_steps=1, progress=False)
    mesh = api.mesh(cfg)
    engine = api.parallelize(api.build_model(cfg, mesh.device, meta=True), mesh, cfg)  # this rank's share only
    samples = D.Samples(D.load_tokens(cfg.data)[0], cfg.data.seq_len)
    sampler = D.DistributedSampler(len(samples), cfg.train.global_batch, dp_rank=mesh.coord(DP),
                                   dp_size=mesh.size(DP), seed=cfg.train.seed)
    losses = []
    for step in range(cfg.train.steps):
        mine = sampler.local_indices(step)
        microbatches = [samples.batch(mine[i:i + cfg.micro_batch])
                        for i in range(0, len(mine), cfg.micro_batch)]
        tokens = D.valid_tokens(sampler.global_indices(step), cfg.data.seq_len)
        engine.zero_grad()
        loss = engine.forward_backward(microbatches, loss_scale=1 / tokens)
        norm = engine.clip_grad_norm_(cfg.optim.grad_clip)
        engine.step(api.lr_at(step, cfg))
        losses.append(loss.total.item() / tokens)
        if dist.get_rank() == 0:
            print(f"step {step + 1}: loss {losses[-1]:.4f}, grad norm {norm.item():.3f}", flush=True)
    weights = engine.full_state_dict()  # unsharded, under the plain model's names (collective)
    if dist.get_rank() == 0:
        print(f"trained {sum(w.numel() for w in weights.values())} parameters at "
              f"{cfg.describe_layout()}", flush=True)
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a local Hugging Face Llama directory")
    parser.add_argument("--make-tiny", metavar="DIR", help="write a tiny random Llama to DIR and train it")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--dp", type=int, default=0)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--zero", type=int, default=0)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print the losses as JSON at the end")
    args = parser.parse_args()
    if args.make_tiny:
        make_tiny_llama(args.make_tiny)
        args.model = args.make_tiny
    if not args.model:
        parser.error("give --model DIR (a Hugging Face Llama directory) or --make-tiny DIR")
    api.config(model=args.model, nproc=args.nproc, tp=args.tp, dp=args.dp, pp=args.pp,
               zero=args.zero, seq_len=64, global_batch=8, micro_batch=2, steps=args.steps)  # fail early
    losses = api.spawn(worker, args.nproc, args)[0]
    if args.json:
        print(json.dumps({"losses": losses}))


if __name__ == "__main__":
    main()
