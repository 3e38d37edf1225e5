import sys, itertools, torch
sys.path.insert(0, 'bench'); sys.path.insert(0, 'python')
import nvfp4_kernel_bench as B
from freetoken.kernels import nvfp4_half_gemv as hg
from freetoken.kernels.nvfp4_linear import nvfp4_linear_triton
dev = torch.device('cuda')
N, K = 248320, 2048
nbytes_w = N*K//2 + N*K//16
weights = B.nvfp4_weights(N, K, 2, dev)
def t_us(fn):
    return B.time_calls(B.cycled(fn, weights, 20), dev) * 1e6
for M in (1, 2, 3, 4):
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    res = {}
    for path in ('gemv', 'half', 'dot'):
        res[path] = t_us(lambda w, p=path: nvfp4_linear_triton(x, *w, path=p))
    pairs = hg.half_pairs(x)
    out = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
    def gem(w, bn=32, bw=64, warps=4, stages=3, asm=True):
        hg.launch_half_gemv(x, w[0].view(torch.int32), w[1].view(torch.uint8), w[2], None, out, bn, bw, 1, K // 8, stages, warps, asm=asm, pairs=pairs)
    for bn, bw, warps, stages in itertools.product((16, 32, 64, 128), (16, 32, 64), (4, 8), (3,)):
        if bn * bw * 4 > 32768 or bn * bw < 128 * warps // 2:
            continue
        try:
            res[f'bn{bn} bw{bw} w{warps} s{stages}'] = t_us(lambda w: gem(w, bn, bw, warps, stages))
        except Exception as e:
            res[f'bn{bn} bw{bw} w{warps} s{stages}'] = float('nan')
    for k, v in sorted(res.items(), key=lambda kv: kv[1])[:14]:
        print(f'M={M} {k:28s} {v:8.1f} us  {nbytes_w / v / 1e3:7.0f} GB/s')
    sys.stdout.flush()
