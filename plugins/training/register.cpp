// Entry point of the kiln-training plugin: registers the training passes (chunk-cross-entropy, autocast, fp8-training, autodiff, accumulate-gemm, remat, optimizer, decompose-losses).
#include "autodiff.h"
#include "fp8_training.h"
#include "kiln/plugin.h"

namespace {

kiln::Status register_training(kiln::Registry& r) {
  KILN_RETURN_IF_ERROR(kiln::training::register_fp8_training_ops());
  KILN_RETURN_IF_ERROR(r.add_pass(kiln::training::autocast_pass_info()));
  KILN_RETURN_IF_ERROR(r.add_pass(kiln::training::autodiff_pass_info()));
  KILN_RETURN_IF_ERROR(r.add_pass(kiln::training::accumulate_gemm_pass_info()));
  KILN_RETURN_IF_ERROR(r.add_pass(kiln::training::remat_pass_info()));
  KILN_RETURN_IF_ERROR(r.add_pass(kiln::training::decompose_losses_pass_info()));
  KILN_RETURN_IF_ERROR(r.add_pass(kiln::training::chunk_cross_entropy_pass_info()));
  KILN_RETURN_IF_ERROR(r.add_pass(kiln::training::fp8_training_pass_info()));
  return r.add_pass(kiln::training::optimizer_pass_info());
}

}  // namespace

KILN_PLUGIN("kiln-training", "0.1.0", register_training)
