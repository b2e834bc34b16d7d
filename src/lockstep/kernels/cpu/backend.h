// The CPU backend: binds every op of the seam (kernels/ops.h) to its CPU kernel.
#pragma once

#include "lockstep/kernels/ops.h"

namespace lockstep {

void bind_cpu_ops(Ops& ops);

}  // namespace lockstep
