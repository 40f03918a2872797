// torch.autocast("emu") with CUDA's cast policy, for roundpipe's emulated accelerator (see
// [Note: emulated autocast] in emu.py): the very op lists torch registers for AutocastCUDA
// (ATen/autocast_mode.h keeps them for other backends to share), registered for
// AutocastPrivateUse1 while the rule is on and removed when it is switched off. A library of its
// own, apart from _emu_guard.cpp: its templates take most of a minute to compile, once.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <memory>
#include <mutex>
#include <string>

namespace at::roundpipe_emu {
at::Tensor binary_cross_entropy_refused(const at::Tensor&, const at::Tensor&,
                                        const std::optional<at::Tensor>&, int64_t) {
  TORCH_CHECK(false,
              "binary_cross_entropy is refused under CUDA's autocast (and the emulated "
              "device's): a sigmoid before it loses precision in fp16; use "
              "binary_cross_entropy_with_logits (nn.BCEWithLogitsLoss), which autocast runs in "
              "fp32");
}

std::mutex autocast_mutex;
thread_local std::string last_error;
std::unique_ptr<torch::Library> cuda_autocast;

void register_cuda_autocast(torch::Library& m) {
#define ROUNDPIPE_EMU_LOWER(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
#define ROUNDPIPE_EMU_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
#define ROUNDPIPE_EMU_FP32_OPT_DTYPE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
#define ROUNDPIPE_EMU_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)
  AT_FORALL_LOWER_PRECISION_FP(ROUNDPIPE_EMU_LOWER)
  KERNEL_PRIVATEUSEONE(cudnn_convolution, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(cudnn_convolution_transpose, lower_precision_fp)
  AT_FORALL_FP32(ROUNDPIPE_EMU_FP32)
  AT_FORALL_FP32_SET_OPT_DTYPE(ROUNDPIPE_EMU_FP32_OPT_DTYPE)
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE)
  AT_FORALL_PROMOTE(ROUNDPIPE_EMU_PROMOTE)
  m.impl(TORCH_SELECTIVE_NAME("aten::binary_cross_entropy"),
         TORCH_FN((&binary_cross_entropy_refused)));
#undef ROUNDPIPE_EMU_LOWER
#undef ROUNDPIPE_EMU_FP32
#undef ROUNDPIPE_EMU_FP32_OPT_DTYPE
#undef ROUNDPIPE_EMU_PROMOTE
}
}  // namespace at::roundpipe_emu

extern "C" {
// Register (on != 0) or remove CUDA's autocast policy for the emulated device. Returns nonzero
// with roundpipe_emu_autocast_error() set if registering failed.
int roundpipe_emu_cuda_autocast(int on) {
  try {
    using at::roundpipe_emu::cuda_autocast;
    std::lock_guard<std::mutex> lock(at::roundpipe_emu::autocast_mutex);
    if (!on) {
      cuda_autocast.reset();
      return 0;
    }
    if (cuda_autocast) return 0;
    auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, "aten",
                                                c10::DispatchKey::AutocastPrivateUse1,
                                                __FILE__, __LINE__);
    at::roundpipe_emu::register_cuda_autocast(*lib);
    cuda_autocast = std::move(lib);
    return 0;
  } catch (const c10::Error& e) {
    at::roundpipe_emu::last_error = e.what_without_backtrace();
  } catch (const std::exception& e) {
    at::roundpipe_emu::last_error = e.what();
  }
  return 1;
}

const char* roundpipe_emu_autocast_error() { return at::roundpipe_emu::last_error.c_str(); }
}  // extern "C"
