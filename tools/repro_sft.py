"Probe (nbs/05a_repro): N SFT steps of the toy base under T torch threads; prints hashes of tokenizer, init, weights."
import hashlib
import os
import sys
import time

from opsd.toy import toy_config, toy_model, toy_tokenizer, train_sft


def weights_hash(model) -> str:
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()[:12]


if __name__ == "__main__":
    steps, threads = int(sys.argv[1]), int(sys.argv[2])
    tok = toy_tokenizer()
    cfg = toy_config("soft", sft_steps=steps, sft_threads=threads)
    model = toy_model(cfg, tok)
    init = weights_hash(model)
    t0 = time.time()
    losses = train_sft(model, tok, cfg, progress=False)
    pins = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "ATEN_CPU_CAPABILITY", "MKL_CBWR")}
    print("tokenizer", hashlib.sha256(tok.backend_tokenizer.to_str().encode()).hexdigest()[:12], "init", init,
          "trained", weights_hash(model), "last loss", repr(losses[-1]), f"{time.time() - t0:.1f} s", pins)
