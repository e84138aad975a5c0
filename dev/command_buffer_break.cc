// A custom call that does nothing and that XLA cannot put into a command buffer (no
// kCmdBufferCompatible trait): in a step, it ends the command buffer before it and starts
// another after it, so that XLA launches the step's CUDA graph in parts. probe_launch.py
// --parts loads it (built by device_check.sh's `launch` mode) to see whether the GPU starts on
// a step's first part while the host still launches the rest.
//
// Its one result aliases its one operand (input_output_aliases {0: 0}), so it moves no data.
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

static ffi::Error Nothing(ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer>) {
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(CommandBufferBreak, Nothing,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());
