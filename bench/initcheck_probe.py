"""Does compute-sanitizer's initcheck see a kernel's TMA stores? (GPU; run under initcheck)

    compute-sanitizer --tool initcheck python bench/initcheck_probe.py {torch|fwd} [arch]

torch: a torch.empty filled by a torch kernel, then read by one (the control: 0 errors).
fwd:   flash_attn_func's output (torch.empty, written by our forward: TMA stores on hopper,
       st.global on ampere), then read by torch. An error here with 0 for the control and
       for ampere means initcheck does not count TMA stores as writes.
"""
import sys

import torch

what = sys.argv[1]
arch = sys.argv[2] if len(sys.argv) > 2 else "hopper"
if what == "torch":
    x = torch.empty(2, 77, 4, 64, device="cuda", dtype=torch.bfloat16)
    x.fill_(1.0)
    print("sum", float(x.float().sum()))
else:
    from flash_cute import flash_attn_func

    q, k, v = (torch.randn(2, 77, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out, _ = flash_attn_func(q, k, v, arch=arch)
    torch.cuda.synchronize()
    print("forward done", flush=True)
    print("sum", float(out.float().sum()))
