"""One hopper forward (hdim 128, 8k, non-causal) with and without dropout between
cudaProfilerStart/Stop, for `ncu --profile-from-start off` (bench/dropout.py times them;
this shows which pipes dropout's Philox rounds load).

    ncu --profile-from-start off --section ComputeWorkloadAnalysis --section SpeedOfLight \
        python bench/dropout_profile.py
"""

import torch

from flash_cute import flash_attn_func

q, k, v = (torch.randn(2, 8192, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
for p in (0.0, 0.1):
    flash_attn_func(q, k, v, dropout_p=p)
torch.cuda.synchronize()
torch.cuda.profiler.start()
for p in (0.0, 0.1):
    flash_attn_func(q, k, v, dropout_p=p)
torch.cuda.synchronize()
torch.cuda.profiler.stop()
