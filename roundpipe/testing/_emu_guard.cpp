// The native half of roundpipe's emulated accelerator (see roundpipe/testing/emu.py).
//
// torch's autograd engine starts one worker thread per accelerator device it knows of, and it
// learns about a device type only from a C++ DeviceGuardImplInterface. Registering this guard
// for PrivateUse1 makes backward of "emu" tensors run off the calling thread, as on CUDA. Every
// method is noexcept-safe and never calls into Python: the engine calls some of them from its
// own threads while an error is being propagated.
//
// The guard also keeps the streams' happens-before order (vector clocks), which emu.py's
// dispatcher checks every op against, and runs the host side of non-blocking copies when the
// host learns they are done (see [Note: emulated streams] in emu.py).
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace {
using namespace c10;

// How many emulated devices exist ("emu:0" .. "emu:3"); the autograd engine starts a thread for
// each. Keep in sync with emu.py's DEVICE_COUNT.
constexpr DeviceIndex kDeviceCount = 4;

thread_local DeviceIndex current_device = 0;
thread_local StreamId current_stream[kDeviceCount] = {};
// CUDA hands out the streams of a pool of 32 per device, round-robin, so a new torch.Stream may
// be one handed out before (see [Note: emulated stream pool] in emu.py); without the rule, every
// stream is new (ids above the pool's).
constexpr StreamId kStreamsPerPool = 32;
std::atomic<bool> stream_pool{false};
std::atomic<int64_t> next_in_pool[kDeviceCount] = {};
std::atomic<StreamId> next_stream{kStreamsPerPool + 1};

// Happens-before between streams. A stream is keyed by (stream id, device); its ops are counted
// in the order they are enqueued. A Clock says, per stream, how many of its ops are known done.
using Clock = std::unordered_map<int64_t, int64_t>;

int64_t stream_key(int64_t device, int64_t stream) { return stream * kDeviceCount + device; }

// A device without an index (plain "emu") means the calling thread's current device.
Device indexed(Device d) {
  return d.has_index() ? d : Device(DeviceType::PrivateUse1, current_device);
}

void merge(Clock& into, const Clock& from) {
  for (const auto& [key, count] : from) {
    int64_t& mine = into[key];
    mine = std::max(mine, count);
  }
}

struct EventState {
  Clock clock;  // what is done once the event is: its stream up to the record, and what that
                // stream had waited for
};

// Host memory written or read by a non-blocking copy that the host has not waited for yet.
struct Pending {
  bool download;     // device to host: write `snap` into `host` once the host waits for it
  void* host;
  const void* snap;  // the copy's data as it was when the copy was enqueued
  int64_t nbytes;
  int64_t key;       // the stream it was enqueued on, and its op count there
  int64_t count;
};

std::mutex clock_mutex;
std::unordered_map<int64_t, int64_t> enqueued;  // stream key -> ops enqueued so far
std::unordered_map<int64_t, Clock> seen;        // stream key -> what its next op may rely on
Clock host_seen;                                // what the host has waited for
std::map<int64_t, Pending> pending;             // id -> copy; ids grow
std::unordered_set<int64_t> finished;           // ids whose host side ran, until asked for
int64_t next_pending = 1;
// Whether Event.query() and Stream.query() answer as a GPU may: done only once the host has
// waited for that work (see [Note: emulated event queries] in emu.py). Else they wait first.
std::atomic<bool> honest_queries{false};
// The streams autograd's engine handed gradients to (recordDataPtrOnStream).
std::unordered_set<int64_t> autograd_recorded;

// Whether the host knows every op in `clock` done (clock_mutex held).
bool host_knows_locked(const Clock& clock) {
  for (const auto& [key, count] : clock) {
    auto known = host_seen.find(key);
    if (count > 0 && (known == host_seen.end() || known->second < count)) return false;
  }
  return true;
}

// Run the host side of every pending copy the host now knows is done (clock_mutex held).
// A download writes its data; an upload checks that the host left its source alone.
void settle_locked() {
  std::string error;
  for (auto it = pending.begin(); it != pending.end();) {
    const Pending& p = it->second;
    auto known = host_seen.find(p.key);
    if (known == host_seen.end() || known->second < p.count) {
      ++it;
      continue;
    }
    if (p.download) {
      std::memcpy(p.host, p.snap, p.nbytes);
    } else if (error.empty() && std::memcmp(p.host, p.snap, p.nbytes) != 0) {
      error = "host memory that a non-blocking upload reads was written before the host "
              "waited for that upload (stream " + std::to_string(p.key / kDeviceCount) +
              " of emu:" + std::to_string(p.key % kDeviceCount) + "): on a GPU the device may "
              "read the new bytes; wait for an event recorded after the copy, or synchronize, "
              "before writing the source";
    }
    finished.insert(it->first);
    it = pending.erase(it);
  }
  TORCH_CHECK(error.empty(), error);
}

void host_waits_for_stream_locked(int64_t key) {
  merge(host_seen, seen[key]);
  int64_t& known = host_seen[key];
  known = std::max(known, enqueued[key]);
}

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
    d = indexed(d);
    return Stream(Stream::UNSAFE, d, current_stream[d.index()]);
  }
  Stream getNewStream(Device d, int) const override {
    d = indexed(d);
    if (stream_pool) {
      return Stream(Stream::UNSAFE, d, 1 + next_in_pool[d.index()]++ % kStreamsPerPool);
    }
    return Stream(Stream::UNSAFE, d, next_stream++);
  }
  Stream exchangeStream(Stream s) const noexcept override {
    Device d = indexed(s.device());
    StreamId& slot = current_stream[d.index()];
    Stream old(Stream::UNSAFE, d, slot);
    slot = s.id();
    return old;
  }
  DeviceIndex deviceCount() const noexcept override { return kDeviceCount; }
  // Kernels run on the host at once, but the order a GPU would guarantee is kept as clocks: an
  // event holds its stream's clock at the record, a wait merges it into the waiting stream, and
  // a synchronize merges it into the host's (then pending copies settle).
  void record(void** event, const Stream& stream, const DeviceIndex,
              const EventFlag) const override {
    std::lock_guard<std::mutex> lock(clock_mutex);
    if (*event == nullptr) *event = new EventState();
    auto* state = static_cast<EventState*>(*event);
    int64_t key = stream_key(indexed(stream.device()).index(), stream.id());
    state->clock = seen[key];
    state->clock[key] = enqueued[key];
  }
  void block(void* event, const Stream& stream) const override {
    if (event == nullptr) return;
    std::lock_guard<std::mutex> lock(clock_mutex);
    merge(seen[stream_key(indexed(stream.device()).index(), stream.id())],
          static_cast<EventState*>(event)->clock);
  }
  bool queryEvent(void* event) const override {
    if (event == nullptr) return true;  // never recorded: complete, as on CUDA
    if (honest_queries) {
      std::lock_guard<std::mutex> lock(clock_mutex);
      return host_knows_locked(static_cast<EventState*>(event)->clock);
    }
    synchronizeEvent(event);  // done at once; whoever asks may then read the results
    return true;
  }
  void destroyEvent(void* event, const DeviceIndex) const noexcept override {
    std::lock_guard<std::mutex> lock(clock_mutex);
    delete static_cast<EventState*>(event);
  }
  bool queryStream(const Stream& stream) const override {
    if (honest_queries) {
      std::lock_guard<std::mutex> lock(clock_mutex);
      int64_t key = stream_key(indexed(stream.device()).index(), stream.id());
      auto known = host_seen.find(key);
      int64_t count = enqueued[key];
      return count == 0 || (known != host_seen.end() && known->second >= count);
    }
    synchronizeStream(stream);
    return true;
  }
  void synchronizeStream(const Stream& stream) const override {
    std::lock_guard<std::mutex> lock(clock_mutex);
    host_waits_for_stream_locked(stream_key(indexed(stream.device()).index(), stream.id()));
    settle_locked();
  }
  void synchronizeEvent(void* event) const override {
    if (event == nullptr) return;
    std::lock_guard<std::mutex> lock(clock_mutex);
    merge(host_seen, static_cast<EventState*>(event)->clock);
    settle_locked();
  }
  void synchronizeDevice(const DeviceIndex device) const override {
    const DeviceIndex index = device < 0 ? current_device : device;
    std::lock_guard<std::mutex> lock(clock_mutex);
    for (const auto& [key, count] : enqueued) {
      if (key % kDeviceCount == index) host_waits_for_stream_locked(key);
    }
    settle_locked();
  }
  double elapsedTime(void*, void*, const DeviceIndex) const override { return 0.0; }
  // torch's autograd engine records a gradient it hands from one stream to another on the
  // consumer stream (record_stream_any_impl), through this. An emulated tensor's own storage
  // is a placeholder without data, so the tensor cannot be named here: the stream is
  // remembered instead (see [Note: emulated allocator reuse] in emu.py).
  void recordDataPtrOnStream(const c10::DataPtr&, const Stream& stream) const override {
    std::lock_guard<std::mutex> lock(clock_mutex);
    autograd_recorded.insert(stream_key(indexed(stream.device()).index(), stream.id()));
  }
};
C10_REGISTER_GUARD_IMPL(PrivateUse1, EmuGuard);

// What emu.py's dispatcher calls, through ctypes. Errors come back as a nonzero return and the
// message from roundpipe_emu_error(), never as a C++ exception across the C boundary.
thread_local std::string last_error;

template <typename F>
int guarded(F&& f) {
  try {
    f();
    return 0;
  } catch (const c10::Error& e) {
    last_error = e.what_without_backtrace();
    return 1;
  } catch (const std::exception& e) {
    last_error = e.what();
    return 1;
  }
}
}  // namespace

extern "C" {
// The calling thread's current stream on a device.
int64_t roundpipe_emu_current_stream(int64_t device) { return current_stream[device]; }

// Enqueue one op on a stream: returns its count there. The op may rely on whatever the host
// has waited for (the host enqueues it afterwards).
int64_t roundpipe_emu_enqueue(int64_t device, int64_t stream) {
  std::lock_guard<std::mutex> lock(clock_mutex);
  int64_t key = stream_key(device, stream);
  merge(seen[key], host_seen);
  return ++enqueued[key];
}

// How many ops of stream (wdevice, wstream) the stream (device, stream) may rely on.
int64_t roundpipe_emu_known(int64_t device, int64_t stream, int64_t wdevice, int64_t wstream) {
  std::lock_guard<std::mutex> lock(clock_mutex);
  int64_t key = stream_key(device, stream), wkey = stream_key(wdevice, wstream);
  if (key == wkey) return enqueued[key];
  auto it = seen[key].find(wkey);
  return it == seen[key].end() ? 0 : it->second;
}

// How many ops of stream (device, stream) the host has waited for.
int64_t roundpipe_emu_host_known(int64_t device, int64_t stream) {
  std::lock_guard<std::mutex> lock(clock_mutex);
  auto it = host_seen.find(stream_key(device, stream));
  return it == host_seen.end() ? 0 : it->second;
}

// How many ops have been enqueued on stream (device, stream).
int64_t roundpipe_emu_enqueued(int64_t device, int64_t stream) {
  std::lock_guard<std::mutex> lock(clock_mutex);
  return enqueued[stream_key(device, stream)];
}

void roundpipe_emu_set_honest_queries(int on) { honest_queries = on != 0; }

void roundpipe_emu_set_stream_pool(int on) { stream_pool = on != 0; }

// Whether autograd's engine recorded gradients it handed to this stream.
int roundpipe_emu_autograd_recorded(int64_t device, int64_t stream) {
  std::lock_guard<std::mutex> lock(clock_mutex);
  return autograd_recorded.count(stream_key(device, stream)) > 0 ? 1 : 0;
}

// Each stream waits for the other (a copy between devices orders both current streams).
void roundpipe_emu_join(int64_t device_a, int64_t stream_a, int64_t device_b, int64_t stream_b) {
  std::lock_guard<std::mutex> lock(clock_mutex);
  int64_t a = stream_key(device_a, stream_a), b = stream_key(device_b, stream_b);
  Clock ca = seen[a], cb = seen[b];
  ca[a] = std::max(ca[a], enqueued[a]);
  cb[b] = std::max(cb[b], enqueued[b]);
  merge(seen[a], cb);
  merge(seen[b], ca);
}

// The host waits for a stream (a blocking copy to the host, or .item()).
int roundpipe_emu_host_waits(int64_t device, int64_t stream) {
  return guarded([&] {
    std::lock_guard<std::mutex> lock(clock_mutex);
    host_waits_for_stream_locked(stream_key(device, stream));
    settle_locked();
  });
}

// A non-blocking copy between pinned host memory and the device, enqueued as op `count` of a
// stream: a download writes `snap` into `host` once the host waits for it; an upload checks
// then that `host` still equals `snap`. Returns an id for roundpipe_emu_finished.
int64_t roundpipe_emu_pending(int download, void* host, const void* snap, int64_t nbytes,
                              int64_t device, int64_t stream, int64_t count) {
  std::lock_guard<std::mutex> lock(clock_mutex);
  int64_t id = next_pending++;
  pending[id] = Pending{download != 0, host, snap, nbytes, stream_key(device, stream), count};
  return id;
}

// A device op ordered after pending download `id` reads its host memory: the bytes land now.
void roundpipe_emu_land(int64_t id) {
  std::lock_guard<std::mutex> lock(clock_mutex);
  auto it = pending.find(id);
  if (it == pending.end()) return;
  std::memcpy(it->second.host, it->second.snap, it->second.nbytes);
  finished.insert(id);
  pending.erase(it);
}

// Whether a pending copy's host side has run (then its buffers may go); forgets it once true.
int roundpipe_emu_finished(int64_t id) {
  std::lock_guard<std::mutex> lock(clock_mutex);
  return finished.erase(id) > 0 ? 1 : 0;
}

const char* roundpipe_emu_error() { return last_error.c_str(); }
}  // extern "C"


namespace {


// pin_memory() on the emulated accelerator: host memory from the CPU allocator, remembered so
// that is_pinned() answers True for it and only for it. Each allocation takes the next power of
// two of its size, as CUDA's caching host allocator rounds it (CachingHostAllocator.h, default
// config), and is counted (see [Note: emulated pinned memory] in emu.py). A freed rounded
// block is kept for reuse by a request of its size, as CUDA's is (while the rule is on).
std::mutex pinned_mutex;
std::unordered_map<const void*, std::pair<int64_t, int64_t>> pinned;  // ptr -> (taken, asked)
// Freed rounded blocks kept for reuse, by size, as CUDA's caching host allocator keeps them
// (while the rule is on); a block is reused whole by a request of its size class.
std::unordered_map<int64_t, std::vector<void*>> pinned_cache;
bool pinned_caching = false;
int64_t pinned_cached = 0;     // bytes in pinned_cache
int64_t pinned_taken = 0;      // live bytes, rounded: what the host gives
int64_t pinned_asked = 0;      // live bytes as requested
int64_t pinned_peak = 0;       // the most pinned_taken has been since the last reset
int64_t pinned_count = 0;      // live allocations
int64_t pinned_round_limit = int64_t{1} << 62;  // larger allocations are not rounded, as
                                               // torch's pinned_max_round_threshold_mb

size_t power_of_two_ceil(size_t n) {
  size_t p = 1;
  while (p < n) p <<= 1;
  return p;
}

void pinned_free(void* ptr) {
  {
    std::lock_guard<std::mutex> lock(pinned_mutex);
    auto it = pinned.find(ptr);
    if (it != pinned.end()) {
      const auto [taken, asked] = it->second;
      pinned_taken -= taken;
      pinned_asked -= asked;
      pinned_count -= 1;
      pinned.erase(it);
      if (pinned_caching && taken > 0 && asked <= pinned_round_limit) {  // a rounded block
        pinned_cache[taken].push_back(ptr);
        pinned_cached += taken;
        return;
      }
    }
  }
  GetCPUAllocator()->raw_deallocate(ptr);
}

// Give the cached blocks back (pinned_mutex held).
void pinned_empty_cache_locked() {
  for (auto& [size, blocks] : pinned_cache) {
    for (void* block : blocks) GetCPUAllocator()->raw_deallocate(block);
  }
  pinned_cache.clear();
  pinned_cached = 0;
}

struct PinnedAllocator final : Allocator {
  DataPtr allocate(size_t nbytes) override {
    size_t taken = 0;
    {
      std::lock_guard<std::mutex> lock(pinned_mutex);
      taken = static_cast<int64_t>(nbytes) > pinned_round_limit ? nbytes : power_of_two_ceil(nbytes);
    }
    if (nbytes == 0) taken = 0;
    void* ptr = nullptr;
    {
      std::lock_guard<std::mutex> lock(pinned_mutex);
      auto cached = pinned_cache.find(static_cast<int64_t>(taken));
      if (taken > 0 && cached != pinned_cache.end() && !cached->second.empty()) {
        ptr = cached->second.back();
        cached->second.pop_back();
        pinned_cached -= static_cast<int64_t>(taken);
      }
    }
    if (ptr == nullptr) {
      ptr = GetCPUAllocator()->raw_allocate(taken ? taken : 1);
      // Page-locked memory is resident from the start, all of it, the rounding's slack too;
      // the CPU allocator's pages would be only once written
      // (see [Note: emulated pinned memory] in emu/memory.py).
      auto* bytes = static_cast<volatile char*>(ptr);
      for (size_t page = 0; page < taken; page += 4096) bytes[page] = 0;
      if (taken > 0) bytes[taken - 1] = 0;  // the last page, where the block is not aligned
    }
    {
      std::lock_guard<std::mutex> lock(pinned_mutex);
      pinned[ptr] = {static_cast<int64_t>(taken), static_cast<int64_t>(nbytes)};
      pinned_taken += static_cast<int64_t>(taken);
      pinned_asked += static_cast<int64_t>(nbytes);
      pinned_count += 1;
      pinned_peak = std::max(pinned_peak, pinned_taken);
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

extern "C" {
// The pinned host allocations: out[0] live bytes taken (rounded), out[1] live bytes asked,
// out[2] peak of out[0] since the last reset, out[3] live allocations, out[4] bytes cached for
// reuse. reset: peak = live.
void roundpipe_emu_set_pinned_round_limit(int64_t limit) {
  std::lock_guard<std::mutex> lock(pinned_mutex);
  pinned_round_limit = limit;
}

void roundpipe_emu_pinned_stats(int64_t* out, int reset) {
  std::lock_guard<std::mutex> lock(pinned_mutex);
  if (reset) pinned_peak = pinned_taken;
  out[0] = pinned_taken;
  out[1] = pinned_asked;
  out[2] = pinned_peak;
  out[3] = pinned_count;
  out[4] = pinned_cached;
}

// Keep freed rounded pinned blocks for reuse (on != 0), or give them back at once.
void roundpipe_emu_set_pinned_cache(int on) {
  std::lock_guard<std::mutex> lock(pinned_mutex);
  pinned_caching = on != 0;
  if (!pinned_caching) pinned_empty_cache_locked();
}

void roundpipe_emu_empty_pinned_cache() {
  std::lock_guard<std::mutex> lock(pinned_mutex);
  pinned_empty_cache_locked();
}
}  // extern "C"

