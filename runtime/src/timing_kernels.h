// The device kernels of Kiln's timing method (runtime/src/model.cpp with enable_timing), shared
// with bench/roofline so its read floors are timed exactly as `kiln bench` times a plan.
#pragma once

#include <cstdint>

namespace kiln::rt {

/// The timing runtime's two kernels, PTX so the driver builds them for whatever GPU the runtime
/// runs on:
/// - kiln_timing_lead spins on the device's global timer for `ns` nanoseconds (one thread);
/// - kiln_l2_sweep reads `bytes` (a multiple of 16) at `p` once across the grid and stores
///   nothing unless the xor of everything read equals `never` (it does not for a zeroed buffer
///   and never = 1): evicts L2 without leaving dirty lines whose write-back would load the steps.
inline constexpr const char* kTimingPtx = R"(.version 7.0
.target sm_50
.address_size 64
.visible .entry kiln_timing_lead(.param .u64 ns) {
  .reg .u64 %t0, %t1, %d, %lim;
  .reg .pred %p;
  ld.param.u64 %lim, [ns];
  mov.u64 %t0, %globaltimer;
WAIT:
  mov.u64 %t1, %globaltimer;
  sub.u64 %d, %t1, %t0;
  setp.lt.u64 %p, %d, %lim;
  @%p bra WAIT;
  ret;
}
.visible .entry kiln_l2_sweep(.param .u64 p, .param .u64 bytes, .param .u32 never) {
  .reg .u64 %a, %end, %off, %stride, %t64;
  .reg .u32 %gi, %bs, %cta, %ncta, %x, %y, %z, %w, %acc, %nv;
  .reg .pred %more, %hit;
  ld.param.u64 %a, [p];
  ld.param.u64 %end, [bytes];
  ld.param.u32 %nv, [never];
  mov.u32 %gi, %tid.x;
  mov.u32 %bs, %ntid.x;
  mov.u32 %cta, %ctaid.x;
  mov.u32 %ncta, %nctaid.x;
  mad.lo.u32 %gi, %cta, %bs, %gi;
  mul.wide.u32 %off, %gi, 16;
  mul.wide.u32 %stride, %bs, 16;
  cvt.u64.u32 %t64, %ncta;
  mul.lo.u64 %stride, %stride, %t64;
  mov.u32 %acc, 0;
  setp.lt.u64 %more, %off, %end;
  @!%more bra DONE;
LOOP:
  add.u64 %t64, %a, %off;
  ld.global.cg.v4.u32 {%x, %y, %z, %w}, [%t64];
  xor.b32 %acc, %acc, %x;
  xor.b32 %acc, %acc, %y;
  xor.b32 %acc, %acc, %z;
  xor.b32 %acc, %acc, %w;
  add.u64 %off, %off, %stride;
  setp.lt.u64 %more, %off, %end;
  @%more bra LOOP;
DONE:
  setp.eq.u32 %hit, %acc, %nv;
  @%hit st.global.u32 [%a], %acc;
  ret;
}
)";

/// kiln_timing_lead's default length (KILN_TIMING_LEAD_US changes it for a runtime).
inline constexpr unsigned long long kTimingLeadNs = 50'000;
/// kiln_l2_sweep's launch shape, and the bytes it reads: twice the L2 (64 MiB assumed where the
/// device does not say).
inline constexpr unsigned kL2SweepBlocks = 1024, kL2SweepThreads = 256;
inline uint64_t l2_sweep_bytes(int l2_size) { return 2 * static_cast<uint64_t>(l2_size > 0 ? l2_size : 64 << 20); }

}  // namespace kiln::rt
