"""Stream marks: a one-thread kernel that stores ``%globaltimer_lo`` (ns) into a buffer,
launched in stream order just before and just after a launch under study.

``decode_timeline.py``'s stamps start at the first CTA's entry and end at the last stamp
a CTA writes. CUDA events around the launch also count what lies outside them: placing
the grid, and the kernel's completion after its last CTA (stores draining, the grid
retiring). In session 65 a merge change moved the last stamp 0.5 µs earlier while the
event time grew 0.6 µs. With a mark before and after, a row splits its event time:

  lead   mark before -> first CTA entry  (the mark's own launch and completion, then ours)
  body   first entry -> last stamp       (the timeline)
  trail  last stamp -> mark after        (our completion, then the next launch's start)

Both marks cost the same in every variant, so differences in lead or trail are the
kernel's own, provided the GPU never waits for the host between them (decode_timeline
spins the GPU first). The marks run in the caller's stream; they are compiled once per
process.
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32


class StreamMark:
    """``buf[index] = %globaltimer_lo`` by one thread of a one-warp grid."""

    @cute.jit
    def __call__(self, buf: cute.Tensor, index: Int32, stream: cuda.CUstream):
        self.kernel(buf, index).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, buf: cute.Tensor, index: Int32):
        if cute.arch.thread_idx()[0] == 0:
            buf[index] = Int32(cute.arch.globaltimer_lo())


_KEPT = {}   # the compiled mark and each buffer's view, per process


def mark(buf, index: int, stream: int) -> None:
    """Launch the mark on ``stream`` (a CUDA stream handle): ``buf`` (a torch int32 tensor on
    the GPU) gets the timer at its ``index`` when the mark runs."""
    from flexattn.kernels.launch.arguments import dlpack_view
    from flexattn.kernels.launch.compile import compile_on_views

    key = ("view", buf.data_ptr(), tuple(buf.shape), str(buf.dtype))   # (a torch tensor)
    view = _KEPT.get(key)
    if view is None:
        view = _KEPT[key] = dlpack_view(buf, 4)
    args = (view, Int32(index), cuda.CUstream(stream))
    fn = _KEPT.get("mark")
    if fn is None:
        fn = _KEPT["mark"] = compile_on_views(StreamMark(), args)[0]
    fn(*args)


def compile_for_ptx():
    """The mark compiled on fake arguments for sm_90a (a CPU check: PTX with the timer read)."""
    from flexattn.kernels.launch.compile import compile_on_fakes
    from flexattn.kernels.launch.fakes import fake_stream, fake_tensor

    return compile_on_fakes(StreamMark(), (fake_tensor(cutlass.Int32, 1, 4), Int32(0), fake_stream(False)),
                            keep_ptx=True)
