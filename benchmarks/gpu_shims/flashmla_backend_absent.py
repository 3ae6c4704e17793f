"""GPU harness only (benchmarks/gpu_serving.sh), never shipped: stands in for SGLang's
``sglang/srt/layers/attention/flashmla_backend.py`` on the lent GPU, whose wheel set has neither
FlashMLA (``sgl-flash-mla``) nor flashinfer, both of which that module imports at its top.

SGLang 0.5.23's EAGLE worker (``eagle_worker_v2._capture_cuda_graphs``) imports ``FlashMLABackend``
on every CUDA start, only to ask whether the draft-extend attention backend is one: with the real
module absent, every EAGLE/EAGLE3 server there stopped at start with ``No module named 'flash_mla'``
after capturing its target-verify and draft-decode graphs. A production install has both wheels
(they are SGLang's requirements), so the shipped code changes nothing. Here no backend can be a
FlashMLA one (the runs use ``--attention-backend triton``), so the class below is never built."""


class FlashMLABackend:
    def __init__(self, *args, **kwargs):
        raise RuntimeError(
            "FlashMLA is not installed in this wheel set (sgl-flash-mla): serve with --attention-backend triton"
        )
