"""The frontier's 22 settings without warm start (fixed 1 … 32; stepnorm, kl and accel at four
τ) decoded side by side (`scoring.decode_policies`, the quality pass of `make frontier`)
on the first <tokens> test tokens of a checkpoint, timed, with an MD5 digest of every
record's NLL and applications (equal digests: bit-for-bit the same records). `--no-kl`
drops kl's four settings (the rule that decodes the LM head at every application).

    python benchmarks/shared_decode.py <last.ckpt> <tokens> [rows a batch, 64] [--no-kl]

Run it from two checkouts (or with each on PYTHONPATH), interleaved, to compare their code.
"""

import hashlib
import sys
import time

import numpy as np
import torch

from recdepth.core.runtime import tune_cpu_allocator
from recdepth.decode.scoring import decode_policies
from recdepth.decode.settings import DecodeSettings
from recdepth.exits import build
from recdepth.app.checkpoints import checkpoint_data, load_checkpoint


def main(argv: list[str]) -> None:
    no_kl = "--no-kl" in argv
    ckpt, n, *rest = [a for a in argv if a != "--no-kl"]
    n, rows = int(n), int(rest[0]) if rest else 64
    tune_cpu_allocator()
    module, data = load_checkpoint(ckpt, torch.device("cpu"))
    tokens = torch.as_tensor(checkpoint_data(module, data, 0).heldout_tokens(n + 1, 0))
    rules = {"stepnorm": [1e-2, 3e-2, 1e-1, 3e-1], "kl": [1e-4, 1e-3, 1e-2, 3e-2], "accel": [1e-2, 3e-2, 1e-1, 3e-1]}
    if no_kl:
        del rules["kl"]
    policies = [build("fixed", None, max_steps=k) for k in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)]
    policies += [build(r, t, max_steps=32) for r, ts in rules.items() for t in ts]
    model = module.model.eval()
    t0 = time.perf_counter()
    recs, _ = decode_policies(model, tokens, policies, n, DecodeSettings(backend="lean", seed=1337, batch_size=rows))
    seconds = time.perf_counter() - t0
    digest = hashlib.md5(b"".join(np.ascontiguousarray(r["nll"]).tobytes() + np.ascontiguousarray(r["apps"]).tobytes()
                                  for r in recs)).hexdigest()
    print(f"{len(policies)} settings x {n} tokens, {rows} rows a batch, {torch.get_num_threads()} threads: "
          f"{seconds:.1f} s; records {digest}")


if __name__ == "__main__":
    main(sys.argv[1:])
