// The native half of roundpipe's emulated accelerator (see roundpipe/testing/emu.py).
//
// torch's autograd engine starts one worker thread per accelerator device it knows of, and it
// learns about a device type only from a C++ DeviceGuardImplInterface. Registering this guard
// for PrivateUse1 makes backward of "emu" tensors run off the calling thread, as on CUDA. Every
// method is noexcept-safe and never calls into Python: the engine calls some of them from its
// own threads while an error is being propagated.
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <atomic>
#include <mutex>
#include <unordered_set>

namespace {
using namespace c10;

// How many emulated devices exist ("emu:0" .. "emu:3"); the autograd engine starts a thread for
// each. Keep in sync with emu.py's DEVICE_COUNT.
constexpr DeviceIndex kDeviceCount = 4;

thread_local DeviceIndex current_device = 0;
thread_local StreamId current_stream = 0;
std::atomic<StreamId> next_stream{1};

struct EmuGuard final : impl::DeviceGuardImplInterface {
  DeviceType type() const override { return DeviceType::PrivateUse1; }
  Device exchangeDevice(Device d) const override {
    Device old = getDevice();
    current_device = d.index();
    return old;
  }
  Device getDevice() const override { return Device(DeviceType::PrivateUse1, current_device); }
  void setDevice(Device d) const override { current_device = d.index(); }
  void uncheckedSetDevice(Device d) const noexcept override { current_device = d.index(); }
  Stream getStream(Device d) const noexcept override {
    return Stream(Stream::UNSAFE, d, current_stream);
  }
  Stream getNewStream(Device d, int) const override {
    return Stream(Stream::UNSAFE, d, next_stream++);
  }
  Stream exchangeStream(Stream s) const noexcept override {
    Stream old(Stream::UNSAFE, s.device(), current_stream);
    current_stream = s.id();
    return old;
  }
  DeviceIndex deviceCount() const noexcept override { return kDeviceCount; }
  // Kernels run synchronously on the host, so an event is complete once it is recorded, and
  // waiting on one or on a stream returns at once.
  void record(void** event, const Stream&, const DeviceIndex, const EventFlag) const override {
    if (*event == nullptr) *event = reinterpret_cast<void*>(0x1);
  }
  void block(void*, const Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const DeviceIndex) const noexcept override {}
  bool queryStream(const Stream&) const override { return true; }
  void synchronizeStream(const Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const DeviceIndex) const override {}
  double elapsedTime(void*, void*, const DeviceIndex) const override { return 0.0; }
};
C10_REGISTER_GUARD_IMPL(PrivateUse1, EmuGuard);

// pin_memory() on the emulated accelerator: host memory from the CPU allocator, remembered so
// that is_pinned() answers True for it and only for it.
std::mutex pinned_mutex;
std::unordered_set<const void*> pinned;

void pinned_free(void* ptr) {
  {
    std::lock_guard<std::mutex> lock(pinned_mutex);
    pinned.erase(ptr);
  }
  GetCPUAllocator()->raw_deallocate(ptr);
}

struct PinnedAllocator final : Allocator {
  DataPtr allocate(size_t nbytes) override {
    void* ptr = GetCPUAllocator()->raw_allocate(nbytes ? nbytes : 1);
    {
      std::lock_guard<std::mutex> lock(pinned_mutex);
      pinned.insert(ptr);
    }
    return {ptr, ptr, &pinned_free, Device(DeviceType::CPU)};
  }
  DeleterFnPtr raw_deleter() const override { return &pinned_free; }
  void copy_data(void* dst, const void* src, std::size_t n) const override {
    default_copy_data(dst, src, n);
  }
};
PinnedAllocator pinned_allocator;

struct EmuHooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(DeviceIndex) const override { return true; }
  bool isPinnedPtr(const void* ptr) const override {
    std::lock_guard<std::mutex> lock(pinned_mutex);
    return pinned.count(ptr) > 0;
  }
  Allocator* getPinnedMemoryAllocator() const override { return &pinned_allocator; }
  Device getDeviceFromPtr(void*) const override { return Device(DeviceType::PrivateUse1, 0); }
};

struct RegisterHooks {
  RegisterHooks() {
    static EmuHooks hooks;
    at::RegisterPrivateUse1HooksInterface(&hooks);
  }
} register_hooks;
}  // namespace
