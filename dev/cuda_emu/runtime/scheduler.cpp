// Kernel execution: every CUDA thread of a block is a fiber (its own stack and registers), run by
// a small scheduler on one OS thread until it finishes or reaches a collective: __syncthreads
// (all non-exited threads of the block), a warp shuffle, vote or __syncwarp (the lanes of its
// mask). So barriers and shuffles really synchronise, and a kernel that reads shared memory
// before the barrier that should order it sees the 0xFF (NaN) fill rather than the value.
// Blocks run one after another (LLMTRAIN_EMU_WORKERS > 1: several at a time, one per OS
// thread). Threads and blocks run in index order by default; LLMTRAIN_EMU_SCHEDULE=reverse or
// random changes both orders, to expose code that depends on them without a barrier.
//
// Checks: launch configuration (block and grid limits), __launch_bounds__, dynamic shared
// memory against the cudaFuncSetAttribute opt-in (48 KB without), static + dynamic against the
// device limit, pointer arguments in device memory (launch.h), collectives whose lanes disagree
// (op, mask, width), masks naming lanes that do not exist or have exited, shuffles from a lane
// outside the mask, deadlocks (threads waiting at different barriers). A device-side fault is
// sticky: every later runtime call fails, as on a GPU.
//
// The context switch is a few lines of x86-64 assembly (callee-saved registers, stack pointer,
// MXCSR and the x87 control word); AddressSanitizer is told of every stack switch.
//
// Under ThreadSanitizer (build with LLMTRAIN_EMU_SANITIZER=thread) every fiber is a TSan fiber,
// and the only happens-before edges between CUDA threads are the ones CUDA gives: the launch
// (host work before it comes before every thread), __syncthreads (within the block), warp
// collectives (within the lanes of the mask), the end of the grid (every thread before the host's
// next step). The emulator's own bookkeeping on a fiber is hidden from TSan. So TSan reports
// shared-memory races within a block and global-memory races between blocks, even though blocks
// run one after another. TSan's runtime tracks at most 256 threads precisely (beyond that,
// threads share "slots" and inherit each other's history, which hides races), so a block gets at
// most 64 TSan contexts, made when it starts and destroyed when it ends: consecutive threads
// share one when the block has more than 64 (races between those are not seen). A fiber's stack
// is reused by the next thread that runs on it, which is ordered after the previous one (a
// token), and the thread-to-fiber assignment moves by the block size from block to block, so
// that consecutive blocks use different stacks.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cuda_runtime.h"
#include "internal.h"

#if defined(__SANITIZE_ADDRESS__)
#define LLMTRAIN_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define LLMTRAIN_EMU_ASAN 1
#endif
#endif
#if LLMTRAIN_EMU_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

#if defined(__SANITIZE_THREAD__)
#define LLMTRAIN_EMU_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define LLMTRAIN_EMU_TSAN 1
#endif
#endif
#if LLMTRAIN_EMU_TSAN
#include <sanitizer/tsan_interface.h>
extern "C" {
void AnnotateIgnoreReadsBegin(const char* file, int line);
void AnnotateIgnoreReadsEnd(const char* file, int line);
void AnnotateIgnoreWritesBegin(const char* file, int line);
void AnnotateIgnoreWritesEnd(const char* file, int line);
void AnnotateIgnoreSyncBegin(const char* file, int line);
void AnnotateIgnoreSyncEnd(const char* file, int line);
}
#endif

#if !defined(__x86_64__)
#error "the CUDA emulator's fiber switch is written for x86-64 only"
#endif

extern "C" void llmtrain_emu_switch_context(void** save_sp, void* load_sp);
extern "C" void llmtrain_emu_fiber_trampoline();

// save_sp: where to store the current stack pointer; load_sp: the stack to resume.
asm(R"(
    .text
    .p2align 4
    .globl llmtrain_emu_switch_context
    .type llmtrain_emu_switch_context, @function
llmtrain_emu_switch_context:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size llmtrain_emu_switch_context, .-llmtrain_emu_switch_context

    .p2align 4
    .globl llmtrain_emu_fiber_trampoline
    .type llmtrain_emu_fiber_trampoline, @function
llmtrain_emu_fiber_trampoline:
    movq %r12, %rdi
    callq *%r13
    ud2
    .size llmtrain_emu_fiber_trampoline, .-llmtrain_emu_fiber_trampoline
)");

namespace llmtrain_emu {
namespace {

constexpr std::size_t stack_bytes = 256 * 1024;  // per CUDA thread (AddressSanitizer frames are large)
constexpr int max_block_threads = 1024;

// Thrown inside a fiber to end its block (a failed launch check, __trap).
struct AbortBlock {};

// The emulator's own work on a fiber (or on freeing what fibers used): its memory accesses and
// locks are not the kernel's, and ThreadSanitizer must neither report nor order them.
struct HarnessScope {
#if LLMTRAIN_EMU_TSAN
  HarnessScope() {
    AnnotateIgnoreReadsBegin(__FILE__, __LINE__);
    AnnotateIgnoreWritesBegin(__FILE__, __LINE__);
    AnnotateIgnoreSyncBegin(__FILE__, __LINE__);
  }
  ~HarnessScope() {
    AnnotateIgnoreSyncEnd(__FILE__, __LINE__);
    AnnotateIgnoreWritesEnd(__FILE__, __LINE__);
    AnnotateIgnoreReadsEnd(__FILE__, __LINE__);
  }
  HarnessScope(const HarnessScope&) = delete;
  HarnessScope& operator=(const HarnessScope&) = delete;
#endif
};

// Happens-before edges between CUDA threads, through a token address (ThreadSanitizer only).
inline void hb_release(const void* token) {
#if LLMTRAIN_EMU_TSAN
  __tsan_release(const_cast<void*>(token));
#else
  (void)token;
#endif
}
inline void hb_acquire(const void* token) {
#if LLMTRAIN_EMU_TSAN
  __tsan_acquire(const_cast<void*>(token));
#else
  (void)token;
#endif
}

enum class State : std::uint8_t { ready, at_barrier, at_warp, done };

struct Fiber {
  void* sp = nullptr;
  char* stack = nullptr;  // lowest usable byte; a PROT_NONE guard page below it
  void* fake_stack = nullptr;
  void* tsan_fiber = nullptr;  // the TSan context of the thread it runs (shared by a few threads)
  char stack_token = 0;        // orders the threads that use this stack one after another (TSan)
  bool fresh = true;     // the context must be (re)initialised before the next switch in
  bool in_body = false;  // inside the kernel (a block abandoned now needs a fresh context)
  State state = State::done;
  uint3 index{0, 0, 0};
  int linear = 0;
  // the collective this thread waits in, and its result
  WarpOp op = WarpOp::sync;
  unsigned mask = 0;
  int param = 0, width = 32;
  std::uint64_t value = 0, result = 0;
  int predicate = 0, count = 0, arrived = 0;
};

struct Warp {
  unsigned arrived = 0;  // lanes waiting in the current collective
  unsigned exited = 0;   // lanes whose thread has finished
  unsigned completed = 0;  // collectives completed (which of two happens-before tokens to use)
  unsigned mask = 0;
  WarpOp op = WarpOp::sync;
  int width = 32;
};

struct Launch {
  LaunchConfig config;
  const char* kernel_text;
  const char* file;
  int line;
  void (*body)(void*);
  void* closure;
  unsigned threads = 0;
  std::atomic<bool> failed{false};
  std::atomic<bool> noted_exited_barrier{false};
  std::mutex mutex;
  std::string kernel_name;  // the kernel's signature, from kernel_entry
  const void* function = nullptr;
  std::size_t static_shared = 0;
  cudaError_t status = cudaSuccess;
  bool sticky = false;
  std::uint64_t seed = 0;
  char* end_token = new char[1];  // every thread releases it when done; the host acquires it

  Launch(const LaunchConfig& c, const char* k, const char* f, int l, void (*b)(void*), void* cl)
      : config(c), kernel_text(k), file(f), line(l), body(b), closure(cl) {}
  ~Launch() {
    const HarnessScope scope;
    delete[] end_token;
  }
  Launch(const Launch&) = delete;
  Launch& operator=(const Launch&) = delete;

  std::string where() {
    std::lock_guard lock(mutex);
    return (kernel_name.empty() ? std::string(kernel_text) : kernel_name) + " launched at " + file + ":" +
           std::to_string(line);
  }
  // Records the first error of the launch; `sticky` for device faults.
  void fail(cudaError_t s, bool is_sticky) {
    std::lock_guard lock(mutex);
    if (status == cudaSuccess) {
      status = s;
      sticky = is_sticky;
    }
    failed = true;
  }
};

struct SharedVariable {
  const void* tag;
  void* data;
  std::size_t bytes;
};

struct Block {
  Launch* launch = nullptr;
  uint3 index{0, 0, 0};
  std::vector<SharedVariable> shared;
  std::size_t static_bytes = 0;
  void* dynamic = nullptr;
  bool entry_checked = false;
  bool aborted = false;
  unsigned barriers = 0;  // __syncthreads completed
  // Happens-before tokens (heap, so that each block's are new to ThreadSanitizer): two for the
  // block barrier and two per warp, alternating, so that a thread running ahead to the next
  // barrier cannot release into the token that slower threads still acquire from.
  std::vector<char> tokens;
};

// One per OS thread that runs blocks: the fibers (reused from block to block) and the state of
// the block being run.
struct Worker {
  // All 1024 up front: a parked fiber's stack holds a pointer to its Fiber, which must not move.
  std::vector<Fiber> fibers = std::vector<Fiber>(max_block_threads);
  // Thread i of the current block runs on fiber slot[i]; the assignment rotates per block.
  std::vector<Fiber*> slot = std::vector<Fiber*>(max_block_threads);
  unsigned rotation = 0;
  void* tsan_scheduler = nullptr;
  std::vector<void*> tsan_contexts;  // of the current block
  void* scheduler_sp = nullptr;
  void* scheduler_fake_stack = nullptr;
  const void* scheduler_stack_bottom = nullptr;
  std::size_t scheduler_stack_size = 0;
  Fiber* current = nullptr;
  Block* block = nullptr;
  unsigned threads = 0;
  std::vector<int> ready;  // a ring of fiber indices
  std::size_t ready_head = 0, ready_count = 0;
  std::vector<int> at_barrier;
  std::vector<Warp> warps;
  unsigned done = 0;

  ~Worker() {
    const HarnessScope scope;  // the fibers' last reads of this are not ordered before it (TSan)
    for (Fiber& f : fibers) {
      if (f.stack) munmap(f.stack - page_size(), stack_bytes + page_size());
      // (TSan fibers are not destroyed: a parked fiber sits inside a HarnessScope.)
    }
    std::vector<Fiber>().swap(fibers);  // freed inside the scope, not by the member destructors
    std::vector<Fiber*>().swap(slot);
    std::vector<int>().swap(ready);
    std::vector<int>().swap(at_barrier);
    std::vector<Warp>().swap(warps);
  }
  static std::size_t page_size() { return std::size_t(sysconf(_SC_PAGESIZE)); }

  void push_ready(int i) {
    ready[(ready_head + ready_count) % ready.size()] = i;
    ++ready_count;
  }
  int pop_ready() {
    const int i = ready[ready_head];
    ready_head = (ready_head + 1) % ready.size();
    --ready_count;
    return i;
  }
};

thread_local Worker* tls_worker = nullptr;

Worker& this_worker() {
  thread_local Worker worker;
  tls_worker = &worker;
  return worker;
}

// ---- fibers ---------------------------------------------------------------------------------------

void start_switch(void** fake_stack_save, const void* bottom, std::size_t size) {
#if LLMTRAIN_EMU_ASAN
  __sanitizer_start_switch_fiber(fake_stack_save, bottom, size);
#else
  (void)fake_stack_save, (void)bottom, (void)size;
#endif
}

void finish_switch(void* fake_stack_save, const void** bottom_old, std::size_t* size_old) {
#if LLMTRAIN_EMU_ASAN
  __sanitizer_finish_switch_fiber(fake_stack_save, bottom_old, size_old);
#else
  (void)fake_stack_save, (void)bottom_old, (void)size_old;
#endif
}

// From a fiber back to its scheduler; returns when the scheduler resumes the fiber. No
// HarnessScope may be open across the switch: the fiber's ThreadSanitizer state would then still
// ignore synchronisation when it is resumed, and drop the happens-before edge of the switch in.
void yield_to_scheduler(Fiber* f) {
  Worker* w;
  void* scheduler_sp;
  void* tsan_scheduler;
  {
    const HarnessScope scope;
    w = tls_worker;
    scheduler_sp = w->scheduler_sp;
    tsan_scheduler = w->tsan_scheduler;
  }
#if LLMTRAIN_EMU_TSAN
  __tsan_switch_to_fiber(tsan_scheduler, __tsan_switch_to_fiber_no_sync);  // now the scheduler's doing
#else
  (void)tsan_scheduler;
#endif
  start_switch(&f->fake_stack, w->scheduler_stack_bottom, w->scheduler_stack_size);
  llmtrain_emu_switch_context(&f->sp, scheduler_sp);
  finish_switch(f->fake_stack, &w->scheduler_stack_bottom, &w->scheduler_stack_size);
}

// A fiber runs thread after thread: the kernel for the thread it was given, then back to the
// scheduler, which resumes it here with the next thread.
[[noreturn]] void fiber_main(Fiber* f) {
  {
    const HarnessScope scope;
    Worker& w = *tls_worker;
    finish_switch(nullptr, &w.scheduler_stack_bottom, &w.scheduler_stack_size);
  }
  for (;;) {
    Launch* launch;
    {
      const HarnessScope scope;
      launch = tls_worker->block->launch;
      f->in_body = true;
    }
    hb_acquire(&f->stack_token);  // the stack's previous thread is done with it
    try {
      launch->body(launch->closure);
    } catch (const AbortBlock&) {
    } catch (const std::exception& e) {
      const HarnessScope scope;
      report("exception in " + launch->where() + ": " + e.what());
      launch->fail(cudaErrorLaunchFailure, true);
      tls_worker->block->aborted = true;
    }
    hb_release(launch->end_token);
    hb_release(&f->stack_token);
    {
      const HarnessScope scope;
      f->in_body = false;
      f->state = State::done;
    }
    yield_to_scheduler(f);
  }
}

void init_context(Fiber& f) {
  const HarnessScope scope;  // the initial frame on a stack the previous thread used (TSan)
  if (!f.stack) {
    const std::size_t page = Worker::page_size();
    void* p = mmap(nullptr, stack_bytes + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    if (p == MAP_FAILED) {
      report("cannot map a fiber stack");
      std::abort();
    }
    mprotect(p, page, PROT_NONE);  // a stack overflow faults instead of corrupting the next stack
    f.stack = static_cast<char*>(p) + page;
  } else {
#if LLMTRAIN_EMU_ASAN
    // Frames abandoned mid-kernel may have left poisoned redzones behind.
    __asan_unpoison_memory_region(f.stack, stack_bytes);
#endif
  }
  const auto top = (reinterpret_cast<std::uintptr_t>(f.stack) + stack_bytes) & ~std::uintptr_t(15);
  // The frame llmtrain_emu_switch_context pops: MXCSR and x87 control word, r15, r14, r13 (the
  // entry point), r12 (its argument), rbx, rbp (0: the end of the frame-pointer chain), and the
  // return address, the trampoline, at an address that is 8 mod 16 (so the call it makes
  // leaves the stack as the ABI wants at a function's entry).
  auto* ret = reinterpret_cast<std::uint64_t*>(top - 24);
  ret[0] = reinterpret_cast<std::uint64_t>(&llmtrain_emu_fiber_trampoline);
  ret[-1] = 0;
  ret[-2] = 0;
  ret[-3] = reinterpret_cast<std::uint64_t>(&f);
  ret[-4] = reinterpret_cast<std::uint64_t>(&fiber_main);
  ret[-5] = 0;
  ret[-6] = 0;
  ret[-7] = 0x1f80ull | (0x037full << 32);
  f.sp = &ret[-7];
  f.fake_stack = nullptr;
  f.fresh = false;
  f.in_body = false;
}

void run_fiber(Worker& w, Fiber& f) {
  if (f.fresh) init_context(f);
  {
    const HarnessScope scope;  // the previous thread's reads of threadIdx are not ordered before this
    w.current = &f;
    threadIdx = f.index;
  }
  void* const sp = f.sp;  // read before TSan takes what follows as the fiber's doing
#if LLMTRAIN_EMU_TSAN
  __tsan_switch_to_fiber(f.tsan_fiber, 0);  // the scheduler's view (launch, indices) goes with it
#endif
  start_switch(&w.scheduler_fake_stack, f.stack, stack_bytes);
  llmtrain_emu_switch_context(&w.scheduler_sp, sp);
  finish_switch(w.scheduler_fake_stack, nullptr, nullptr);
  w.current = nullptr;
}

// ---- faults -----------------------------------------------------------------------------------------

std::string thread_name(const Block& b, const Fiber& f) {
  return "block (" + std::to_string(b.index.x) + "," + std::to_string(b.index.y) + "," + std::to_string(b.index.z) +
         ") thread (" + std::to_string(f.index.x) + "," + std::to_string(f.index.y) + "," +
         std::to_string(f.index.z) + ") [warp " + std::to_string(f.linear / 32) + " lane " +
         std::to_string(f.linear % 32) + "]";
}

const char* op_name(WarpOp op) {
  switch (op) {
    case WarpOp::sync: return "__syncwarp";
    case WarpOp::shfl_idx: return "__shfl_sync";
    case WarpOp::shfl_up: return "__shfl_up_sync";
    case WarpOp::shfl_down: return "__shfl_down_sync";
    case WarpOp::shfl_xor: return "__shfl_xor_sync";
    case WarpOp::ballot: return "__ballot_sync";
    case WarpOp::any: return "__any_sync";
    case WarpOp::all: return "__all_sync";
    case WarpOp::match_any: return "__match_any_sync";
    case WarpOp::matrix: return "a matrix instruction (mma.sync, ldmatrix)";
  }
  return "?";
}

std::string hex(unsigned x) {
  char s[16];
  std::snprintf(s, sizeof s, "0x%08x", x);
  return s;
}

// A device-side fault found by the scheduler: the block stops, the launch fails (sticky).
void fault(Worker& w, const std::string& what) {
  Block& b = *w.block;
  if (!b.aborted) report("device fault in " + b.launch->where() + ": " + what);
  b.aborted = true;
  b.launch->fail(cudaErrorLaunchFailure, true);
}

// ---- collectives -----------------------------------------------------------------------------------

unsigned existing_lanes(const Worker& w, int warp) {
  const unsigned first = unsigned(warp) * 32;
  const unsigned count = std::min(32u, w.threads - first);
  return count == 32 ? 0xffffffffu : (1u << count) - 1;
}

unsigned exited_lanes(const Worker& w, int warp) { return w.warps[std::size_t(warp)].exited; }

// The lane whose value lane `lane` receives (CUDA's rules for width < 32), or -1 for its own.
int shuffle_source(WarpOp op, int lane, int param, int width) {
  const int segment = lane & ~(width - 1);
  switch (op) {
    case WarpOp::shfl_idx: return segment + (param & (width - 1));
    case WarpOp::shfl_up: return lane - param >= segment ? lane - param : lane;
    case WarpOp::shfl_down: return lane + param < segment + width ? lane + param : lane;
    case WarpOp::shfl_xor: {
      const int src = lane ^ param;
      return src >= segment + width ? lane : src;  // later groups: own value
    }
    default: return lane;
  }
}

// True when [p, p + bytes) lies in the current block's shared memory (dynamic or a static variable).
bool is_block_shared(const Worker& w, const void* p, std::size_t bytes) {
  const Block& b = *w.block;
  const auto inside = [&](const void* base, std::size_t size) {
    const auto at = reinterpret_cast<std::uintptr_t>(p), from = reinterpret_cast<std::uintptr_t>(base);
    return base != nullptr && at >= from && at + bytes <= from + size;
  };
  if (inside(b.dynamic, b.launch->config.shared_bytes)) return true;
  for (const SharedVariable& v : b.shared) {
    if (inside(v.data, v.bytes)) return true;
  }
  return false;
}

float bf16_half(std::uint32_t pair, int half) {
  const std::uint32_t bits = half == 0 ? pair << 16 : pair & 0xffff0000u;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// A warp's matrix instruction, every lane parked in it: assembles the operands from the lanes'
// registers by the PTX ISA's fragment layouts (groupID = lane / 4, threadID_in_group = lane % 4)
// and gives each lane its part of the result. Returns an error message, or "" when it succeeded.
std::string complete_matrix(Worker& w, int warp) {
  Fiber* const* fibers = &w.slot[std::size_t(warp) * 32];
  MatrixLane* lanes[32];
  for (int l = 0; l < 32; ++l) lanes[l] = reinterpret_cast<MatrixLane*>(fibers[l]->value);
  const MatrixLane& first = *lanes[0];
  for (int l = 1; l < 32; ++l) {
    if (lanes[l]->kind != first.kind || lanes[l]->count != first.count || lanes[l]->trans != first.trans) {
      return "lanes 0 and " + std::to_string(l) + " of warp " + std::to_string(warp) +
             " are in different matrix instructions (.aligned: the whole warp must run the same one)";
    }
  }
  if (first.kind == MatrixKind::mma_m16n8k16_bf16) {
    // mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32: A 16x16, B 16x8 (k x n), C and D 16x8.
    float A[16][16], B[16][8], C[16][8];
    for (int l = 0; l < 32; ++l) {
      const MatrixLane& L = *lanes[l];
      const int g = l / 4, t = l % 4;
      for (int e = 0; e < 2; ++e) {
        A[g][2 * t + e] = bf16_half(L.a[0], e);
        A[g + 8][2 * t + e] = bf16_half(L.a[1], e);
        A[g][2 * t + 8 + e] = bf16_half(L.a[2], e);
        A[g + 8][2 * t + 8 + e] = bf16_half(L.a[3], e);
        B[2 * t + e][g] = bf16_half(L.b[0], e);
        B[2 * t + 8 + e][g] = bf16_half(L.b[1], e);
        C[g][2 * t + e] = L.c[e];
        C[g + 8][2 * t + e] = L.c[2 + e];
      }
    }
    for (int l = 0; l < 32; ++l) {
      MatrixLane& L = *lanes[l];
      const int g = l / 4, t = l % 4;
      for (int i = 0; i < 4; ++i) {
        const int row = g + 8 * (i / 2), col = 2 * t + i % 2;
        // bf16 products are exact in fp32; the sum is taken in double and rounded once to fp32
        // (the GPU's order of fp32 additions is unspecified).
        double sum = C[row][col];
        for (int k = 0; k < 16; ++k) sum += double(A[row][k]) * double(B[k][col]);
        L.d[i] = float(sum);
      }
    }
    return "";
  }
  if (first.kind == MatrixKind::ldmatrix) {
    // ldmatrix.sync.aligned.m8n8.x{1,2,4}[.trans].shared.b16: matrix j's rows are named by lanes
    // 8j..8j+7; lane l receives row l/4, columns 2(l%4) and 2(l%4)+1 (.trans: the transpose's).
    if (first.count != 1 && first.count != 2 && first.count != 4) return "ldmatrix: .num must be x1, x2 or x4";
    for (int j = 0; j < first.count; ++j) {
      std::uint16_t M[8][8];
      for (int r = 0; r < 8; ++r) {
        const void* row = lanes[8 * j + r]->address;
        if (reinterpret_cast<std::uintptr_t>(row) % 16 != 0) {
          return "ldmatrix: lane " + std::to_string(8 * j + r) + " of warp " + std::to_string(warp) +
                 " names a row address that is not 16-byte aligned (misaligned address)";
        }
        if (!is_block_shared(w, row, 16)) {
          return "ldmatrix: lane " + std::to_string(8 * j + r) + " of warp " + std::to_string(warp) +
                 " names a row of 16 bytes outside the block's shared memory";
        }
        std::memcpy(M[r], row, 16);
      }
      for (int l = 0; l < 32; ++l) {
        const int g = l / 4, t = l % 4;
        const std::uint16_t lo = first.trans ? M[2 * t][g] : M[g][2 * t];
        const std::uint16_t hi = first.trans ? M[2 * t + 1][g] : M[g][2 * t + 1];
        lanes[l]->out[j] = std::uint32_t(lo) | std::uint32_t(hi) << 16;
      }
    }
    return "";
  }
  return "unknown matrix instruction";
}

void complete_warp(Worker& w, int warp) {
  Warp& W = w.warps[std::size_t(warp)];
  Fiber* const* lanes = &w.slot[std::size_t(warp) * 32];  // only the lanes of the mask are read
  if (W.op == WarpOp::matrix) {
    if (W.mask != 0xffffffffu) return fault(w, "a matrix instruction (.sync.aligned) with a mask that is not the full warp");
    const std::string error = complete_matrix(w, warp);
    if (!error.empty()) return fault(w, error + " in " + w.block->launch->where());
  }
  unsigned ballot = 0;
  for (int l = 0; l < 32; ++l) {
    if ((W.mask >> l & 1u) && lanes[l]->value != 0) ballot |= 1u << l;
  }
  for (int l = 0; l < 32; ++l) {
    if (!(W.mask >> l & 1u)) continue;
    Fiber& f = *lanes[l];
    switch (W.op) {
      case WarpOp::sync:
      case WarpOp::matrix: f.result = 0; break;
      case WarpOp::ballot: f.result = ballot; break;
      case WarpOp::any: f.result = ballot != 0; break;
      case WarpOp::all: f.result = ballot == W.mask; break;
      case WarpOp::match_any: {
        unsigned same = 0;
        for (int k = 0; k < 32; ++k) {
          if ((W.mask >> k & 1u) && lanes[k]->value == f.value) same |= 1u << k;
        }
        f.result = same;
        break;
      }
      default: {
        const int src = shuffle_source(W.op, l, f.param, W.width);
        if (src < 0 || src > 31 || !(W.mask >> src & 1u)) {
          fault(w, std::string(op_name(W.op)) + " in " + thread_name(*w.block, f) + " reads lane " +
                       std::to_string(src) + ", which is not in the mask " + hex(W.mask) + " (undefined value)");
          return;
        }
        f.result = lanes[src]->value;
      }
    }
  }
  const auto release = [&](int l) {
    if (W.mask >> l & 1u) {
      lanes[l]->state = State::ready;
      w.push_ready(warp * 32 + l);
    }
  };
  if (settings().schedule == 1) {
    for (int l = 31; l >= 0; --l) release(l);
  } else {
    for (int l = 0; l < 32; ++l) release(l);
  }
  W.arrived = 0;
  ++W.completed;
}

void arrive_at_warp(Worker& w, int i) {
  Fiber& f = *w.slot[std::size_t(i)];
  const int warp = i / 32, lane = i % 32;
  Warp& W = w.warps[std::size_t(warp)];
  const auto who = [&] {
    return std::string(op_name(f.op)) + " in " + thread_name(*w.block, f) + " with mask " + hex(f.mask);
  };
  if (!(f.mask >> lane & 1u)) return fault(w, who() + ": the calling lane is not in its mask");
  if (f.mask & ~existing_lanes(w, warp)) {
    return fault(w, who() + ": the mask names lanes past the end of the block (" + std::to_string(w.threads) +
                        " threads): those lanes do not exist");
  }
  if (f.width < 1 || f.width > 32 || (f.width & (f.width - 1))) {
    return fault(w, who() + ": width " + std::to_string(f.width) + " is not a power of two up to 32");
  }
  if (W.arrived == 0) {
    W.mask = f.mask;
    W.op = f.op;
    W.width = f.width;
  } else if (W.mask != f.mask || W.op != f.op || W.width != f.width) {
    int other = 0;
    while (!(W.arrived >> other & 1u)) ++other;
    return fault(w, who() + " while lane " + std::to_string(other) + " of the warp waits in " + op_name(W.op) +
                        " with mask " + hex(W.mask) + " (divergent collectives)");
  }
  if (const unsigned gone = exited_lanes(w, warp) & f.mask) {
    return fault(w, who() + ": lanes " + hex(gone) + " of the mask have exited (the GPU would hang or read garbage)");
  }
  W.arrived |= 1u << lane;
  if (W.arrived == W.mask) complete_warp(w, warp);
}

void thread_exited(Worker& w, int i) {
  ++w.done;
  const int warp = i / 32, lane = i % 32;
  Warp& W = w.warps[std::size_t(warp)];
  W.exited |= 1u << lane;
  if (W.arrived != 0 && (W.mask >> lane & 1u)) {
    fault(w, thread_name(*w.block, *w.slot[std::size_t(i)]) + " exited while lanes " + hex(W.arrived) + " wait in " +
                 op_name(W.op) + " with a mask " + hex(W.mask) + " that names it");
  }
}

void maybe_release_barrier(Worker& w) {
  if (w.at_barrier.empty() || w.at_barrier.size() + w.done < w.threads) return;
  Launch& launch = *w.block->launch;
  if (w.done > 0 && !launch.noted_exited_barrier.exchange(true)) {
    report("note: in " + launch.where() + ", __syncthreads was passed after " + std::to_string(w.done) + " of " +
           std::to_string(w.threads) +
           " threads had exited (counted as arrived, as GPUs do; the programming guide calls a barrier "
           "not reached by every thread undefined)");
  }
  int count = 0;
  for (const int i : w.at_barrier) count += w.slot[std::size_t(i)]->predicate;
  std::sort(w.at_barrier.begin(), w.at_barrier.end());
  if (settings().schedule == 1) std::reverse(w.at_barrier.begin(), w.at_barrier.end());
  if (settings().schedule == 2) {
    std::mt19937_64 rng(launch.seed + w.done + std::uint64_t(count));
    std::shuffle(w.at_barrier.begin(), w.at_barrier.end(), rng);
  }
  for (const int i : w.at_barrier) {
    Fiber& f = *w.slot[std::size_t(i)];
    f.count = count;
    f.arrived = int(w.at_barrier.size());
    f.state = State::ready;
    w.push_ready(i);
  }
  w.at_barrier.clear();
  ++w.block->barriers;
}

void report_deadlock(Worker& w) {
  std::string waits;
  int shown = 0;
  for (unsigned i = 0; i < w.threads && shown < 8; ++i) {
    const Fiber& f = *w.slot[i];
    if (f.state == State::at_warp || f.state == State::at_barrier) {
      waits += "\n    " + thread_name(*w.block, f) + " waits in " +
               (f.state == State::at_barrier ? std::string("__syncthreads") : std::string(op_name(f.op)) + " mask " + hex(f.mask));
      ++shown;
    }
  }
  fault(w, "deadlock: " + std::to_string(w.threads - w.done) + " threads wait, none can go on (" +
               std::to_string(w.at_barrier.size()) + " at __syncthreads, " + std::to_string(w.done) +
               " exited); for example:" + waits);
}

// ---- blocks -----------------------------------------------------------------------------------------

void* aligned_block(std::size_t bytes, std::size_t alignment) {
  const HarnessScope scope;  // new memory to ThreadSanitizer: no history from the last block's
  void* p = nullptr;
  if (posix_memalign(&p, std::max<std::size_t>(alignment, sizeof(void*)), bytes ? bytes : 16) != 0) {
    report("out of host memory for shared memory");
    std::abort();
  }
  std::memset(p, 0xff, bytes ? bytes : 16);
#if LLMTRAIN_EMU_ASAN
  if (bytes == 0) __asan_poison_memory_region(p, 16);  // no dynamic shared memory: any access is wrong
#endif
  return p;
}

void free_block(void* p, std::size_t bytes) {
  const HarnessScope scope;  // the threads' last accesses are not ordered before this (TSan)
#if LLMTRAIN_EMU_ASAN
  if (bytes == 0) __asan_unpoison_memory_region(p, 16);
#else
  (void)bytes;
#endif
  std::free(p);
}

void run_block(Launch& launch, uint3 block_index) {
  Worker& w = this_worker();
  Block b;
  b.launch = &launch;
  b.index = block_index;
  b.dynamic = aligned_block(launch.config.shared_bytes, 128);
  {
    const HarnessScope scope;
    w.block = &b;
    blockIdx = block_index;
    blockDim = launch.config.block;
    gridDim = launch.config.grid;
  }

  const unsigned n = launch.threads;
  w.threads = n;
  b.tokens.assign(2 + 2 * ((n + 31) / 32), 0);
#if LLMTRAIN_EMU_TSAN
  w.tsan_scheduler = __tsan_get_current_fiber();
#endif
  for (unsigned i = 0; i < n; ++i) w.slot[i] = &w.fibers[(i + w.rotation) % max_block_threads];
  w.rotation = (w.rotation + std::min(n, 512u)) % max_block_threads;  // the next block: other stacks
#if LLMTRAIN_EMU_TSAN
  {
    constexpr unsigned max_contexts = 64;
    const unsigned per_context = (n + max_contexts - 1) / max_contexts;
    w.tsan_contexts.resize((n + per_context - 1) / per_context);
    for (void*& c : w.tsan_contexts) c = __tsan_create_fiber(0);
    for (unsigned i = 0; i < n; ++i) {
      w.slot[i]->tsan_fiber = w.tsan_contexts[i / per_context];
      w.slot[i]->fresh = true;  // a new context must not return through frames of an old one
    }
  }
#endif
  if (w.ready.size() < n) w.ready.resize(n);
  w.ready_head = w.ready_count = 0;
  w.at_barrier.clear();
  w.warps.assign((n + 31) / 32, Warp{});
  w.done = 0;
  const dim3 bd = launch.config.block;
  for (unsigned i = 0; i < n; ++i) {
    Fiber& f = *w.slot[i];
    f.state = State::ready;
    f.linear = int(i);
    f.index = uint3{i % bd.x, (i / bd.x) % bd.y, i / (bd.x * bd.y)};
  }
  std::vector<int> order(n);
  std::iota(order.begin(), order.end(), 0);
  if (settings().schedule == 1) std::reverse(order.begin(), order.end());
  if (settings().schedule == 2) {
    std::mt19937_64 rng(launch.seed ^ (std::uint64_t(block_index.x) << 20) ^ (std::uint64_t(block_index.y) << 40) ^
                        block_index.z);
    std::shuffle(order.begin(), order.end(), rng);
  }
  for (const int i : order) w.push_ready(i);

  while (w.ready_count > 0 && !b.aborted) {
    const int i = w.pop_ready();
    Fiber& f = *w.slot[std::size_t(i)];
    run_fiber(w, f);
    if (b.aborted) break;
    switch (f.state) {
      case State::done: thread_exited(w, i); break;
      case State::at_barrier: w.at_barrier.push_back(i); break;
      case State::at_warp: arrive_at_warp(w, i); break;
      case State::ready: break;
    }
    if (!b.aborted) maybe_release_barrier(w);
  }
  if (!b.aborted && w.done < n) report_deadlock(w);
  if (b.aborted) {
    for (unsigned i = 0; i < n; ++i) {
      if (w.slot[i]->in_body) w.slot[i]->fresh = true;  // abandoned mid-kernel
    }
  }

  // Shared memory limits, now that the block's static __shared__ variables are known.
  if (!b.aborted) {
    const int optin = max_dynamic_shared(launch.function);
    const std::size_t dynamic = launch.config.shared_bytes;
    std::string problem;
    if (b.static_bytes > default_shared_limit) {
      problem = "static shared memory " + std::to_string(b.static_bytes) + " bytes exceeds 48 KB";
    } else if (optin == 0 && b.static_bytes + dynamic > default_shared_limit) {
      problem = "static " + std::to_string(b.static_bytes) + " + dynamic " + std::to_string(dynamic) +
                " bytes of shared memory exceed 48 KB without a cudaFuncSetAttribute opt-in";
    } else if (optin != 0 && b.static_bytes + std::size_t(optin) > settings().max_shared_optin) {
      problem = "static " + std::to_string(b.static_bytes) + " bytes + the opt-in of " + std::to_string(optin) +
                " bytes exceed the device's " + std::to_string(settings().max_shared_optin) + " bytes";
    }
    if (!problem.empty()) {
      report("launch error in " + launch.where() + ": " + problem + " (the GPU would refuse this launch)");
      launch.fail(cudaErrorInvalidValue, false);
    }
    std::lock_guard lock(launch.mutex);
    launch.static_shared = std::max(launch.static_shared, b.static_bytes);
  }
#if LLMTRAIN_EMU_TSAN
  for (void* c : w.tsan_contexts) __tsan_destroy_fiber(c);  // their threads are parked or done
  w.tsan_contexts.clear();
#endif
  for (const SharedVariable& v : b.shared) free_block(v.data, v.bytes);
  free_block(b.dynamic, launch.config.shared_bytes);
  {
    const HarnessScope scope;
    std::vector<char>().swap(b.tokens);
  }
  w.block = nullptr;
}

// ---- the grid ------------------------------------------------------------------------------------------

// Other OS threads that run blocks when LLMTRAIN_EMU_WORKERS > 1.
class Pool {
 public:
  static Pool& get() {
    static Pool* pool = new Pool();  // never destroyed: its threads sleep until exit
    return *pool;
  }

  // Runs blocks [1, count) of `launch` (block 0 has run) on the pool and the calling thread.
  void run(Launch& launch, const std::vector<uint3>& blocks) {
    std::unique_lock lock(mutex_);
    job_ = &launch;
    blocks_ = &blocks;
    next_ = 1;
    busy_ = int(threads_.size());
    ++generation_;
    lock.unlock();
    wake_.notify_all();
    work();
    lock.lock();
    idle_.wait(lock, [&] { return busy_ == 0; });
    job_ = nullptr;
  }

 private:
  Pool() {
    for (int i = 1; i < settings().workers; ++i) threads_.emplace_back([this] { loop(); });
  }

  void work() {
    for (;;) {
      const std::size_t k = next_.fetch_add(1);
      if (k >= blocks_->size() || job_->failed) return;
      run_block(*job_, (*blocks_)[k]);
    }
  }

  void loop() {
    std::uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
      }
      work();
      std::lock_guard lock(mutex_);
      if (--busy_ == 0) idle_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_, idle_;
  std::vector<std::thread> threads_;
  Launch* job_ = nullptr;
  const std::vector<uint3>* blocks_ = nullptr;
  std::atomic<std::size_t> next_{0};
  int busy_ = 0;
  std::uint64_t generation_ = 0;
};

std::string dims(dim3 d) {
  return "(" + std::to_string(d.x) + "," + std::to_string(d.y) + "," + std::to_string(d.z) + ")";
}

std::atomic<std::uint64_t> launch_counter{0};

}  // namespace

// ---- entry points --------------------------------------------------------------------------------------

bool check_pointer_argument(const void* pointer, int index, const char* kernel_text, const char* file, int line) {
  // Inside an allocation (not one past its end: with no redzones that is another allocation).
  if (pointer == nullptr || is_device_range(pointer, 1)) return true;
  report(std::string("launch error: argument ") + std::to_string(index) + " of " + kernel_text + " launched at " +
         file + ":" + std::to_string(line) + " is " + describe_pointer(pointer));
  return false;
}

void fail_launch(cudaError_t status) { set_last_error(status); }

void run_grid(const LaunchConfig& config, const char* kernel_text, const char* file, int line, void (*body)(void*),
              void* closure) {
  if (const cudaError_t s = sticky_error()) {
    set_last_error(s);
    return;
  }
  const std::string where = std::string(kernel_text) + " launched at " + file + ":" + std::to_string(line);
  const dim3 g = config.grid, bl = config.block;
  const std::uint64_t threads = std::uint64_t(bl.x) * bl.y * bl.z;
  std::string problem;
  if (bl.x == 0 || bl.y == 0 || bl.z == 0 || bl.x > 1024 || bl.y > 1024 || bl.z > 64 || threads > max_block_threads) {
    problem = "block " + dims(bl) + " (at most 1024 threads; x, y <= 1024, z <= 64)";
  } else if (g.x == 0 || g.y == 0 || g.z == 0 || g.x > 2147483647u || g.y > 65535 || g.z > 65535) {
    problem = "grid " + dims(g) + " (x in [1, 2^31 - 1], y and z in [1, 65535])";
  }
  if (!problem.empty()) {
    report("launch error in " + where + ": invalid " + problem);
    set_last_error(cudaErrorInvalidConfiguration);
    return;
  }
  if (config.shared_bytes > settings().max_shared_optin) {
    report("launch error in " + where + ": " + std::to_string(config.shared_bytes) +
           " bytes of dynamic shared memory, above the device's " + std::to_string(settings().max_shared_optin));
    set_last_error(cudaErrorInvalidValue);
    return;
  }
  if (!check_stream(config.stream, where.c_str())) {
    set_last_error(cudaErrorInvalidResourceHandle);
    return;
  }

  Launch launch(config, kernel_text, file, line, body, closure);
  launch.threads = unsigned(threads);
  launch.seed = launch_counter.fetch_add(1) * 0x9e3779b97f4a7c15ull;
  std::vector<uint3> blocks;
  blocks.reserve(std::size_t(g.x) * g.y * g.z);
  for (unsigned z = 0; z < g.z; ++z)
    for (unsigned y = 0; y < g.y; ++y)
      for (unsigned x = 0; x < g.x; ++x) blocks.push_back(uint3{x, y, z});
  if (settings().schedule == 1) std::reverse(blocks.begin(), blocks.end());
  if (settings().schedule == 2) {
    std::mt19937_64 rng(launch.seed);
    std::shuffle(blocks.begin(), blocks.end(), rng);
  }
  const auto start = std::chrono::steady_clock::now();

  // The first block alone: its first thread checks the launch (kernel_entry) before any other runs.
  run_block(launch, blocks[0]);
  if (!launch.failed && blocks.size() > 1) {
    if (settings().workers > 1) {
      Pool::get().run(launch, blocks);
    } else {
      for (std::size_t k = 1; k < blocks.size() && !launch.failed; ++k) run_block(launch, blocks[k]);
    }
  }
  hb_acquire(launch.end_token);  // the grid's work comes before the host's next step
  if (launch.failed) {
    if (launch.sticky) {
      set_sticky_error(launch.status);
    } else {
      set_last_error(launch.status);
    }
  }
  if (settings().verbose) {
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    report("launch " + launch.where() + ": grid " + dims(g) + " block " + dims(bl) + " dynamic shared " +
           std::to_string(config.shared_bytes) + " static shared " + std::to_string(launch.static_shared) + ", " +
           std::to_string(ms) + " ms" + (launch.failed ? " FAILED" : ""));
  }
}

void kernel_entry(const void* function, const char* pretty_name, unsigned max_threads_per_block) {
  const HarnessScope scope;
  Worker& w = *tls_worker;
  Block& b = *w.block;
  if (b.entry_checked) return;
  b.entry_checked = true;
  Launch& launch = *b.launch;
  {
    std::lock_guard lock(launch.mutex);
    if (launch.function == nullptr) {
      launch.function = function;
      launch.kernel_name = pretty_name;
    }
  }
  std::string problem;
  cudaError_t status = cudaSuccess;
  if (max_threads_per_block > 0 && launch.threads > max_threads_per_block) {
    problem = std::to_string(launch.threads) + " threads per block, above the kernel's __launch_bounds__(" +
              std::to_string(max_threads_per_block) + ")";
    status = cudaErrorLaunchOutOfResources;
  }
  const int optin = max_dynamic_shared(function);
  const std::size_t limit = optin > 0 ? std::size_t(optin) : default_shared_limit;
  if (problem.empty() && launch.config.shared_bytes > limit) {
    problem = std::to_string(launch.config.shared_bytes) + " bytes of dynamic shared memory, above " +
              (optin > 0 ? "the kernel's cudaFuncSetAttribute(MaxDynamicSharedMemorySize) opt-in of " +
                               std::to_string(optin)
                         : std::string("48 KB (the limit without a cudaFuncSetAttribute opt-in)"));
    status = cudaErrorInvalidValue;
  }
  if (!problem.empty()) {
    report("launch error in " + launch.where() + ": " + problem + " (the GPU would refuse this launch)");
    launch.fail(status, false);
    b.aborted = true;
    throw AbortBlock{};
  }
}

std::uint64_t warp_collective(WarpOp op, unsigned mask, std::uint64_t value, int param, int width) {
  Fiber* f;
  const char* token;
  {
    const HarnessScope scope;
    Worker& w = *tls_worker;
    f = w.current;
    f->op = op;
    f->mask = mask;
    f->value = value;
    f->param = param;
    f->width = width;
    f->state = State::at_warp;
    const int warp = f->linear / 32;
    token = &w.block->tokens[std::size_t(2 + 2 * warp + int(w.warps[std::size_t(warp)].completed % 2))];
  }
  hb_release(token);  // the lanes' work before the collective comes before their work after it
  yield_to_scheduler(f);
  hb_acquire(token);
  const HarnessScope scope;
  return f->result;
}

int block_barrier(int predicate, int* arrived) {
  Fiber* f;
  const char* token;
  {
    const HarnessScope scope;
    Worker& w = *tls_worker;
    f = w.current;
    f->predicate = predicate;
    f->state = State::at_barrier;
    token = &w.block->tokens[w.block->barriers % 2];
  }
  hb_release(token);
  yield_to_scheduler(f);
  hb_acquire(token);
  const HarnessScope scope;
  if (arrived) *arrived = f->arrived;
  return f->count;
}

void* block_shared_storage(const void* tag, std::size_t bytes, std::size_t alignment) {
  const HarnessScope scope;
  Block& b = *tls_worker->block;
  for (const SharedVariable& v : b.shared) {
    if (v.tag == tag) return v.data;
  }
  void* p = aligned_block(bytes, alignment);
  b.shared.push_back(SharedVariable{tag, p, bytes});
  b.static_bytes += bytes;
  return p;
}

void* dynamic_shared_storage() {
  const HarnessScope scope;
  return tls_worker->block->dynamic;
}

void cp_async_16(void* dst, const void* src, int src_bytes) {
  std::string error;
  {
    const HarnessScope scope;
    Worker& w = *tls_worker;
    if (src_bytes < 0 || src_bytes > 16) {
      error = "cp.async: src-size " + std::to_string(src_bytes) + " is not in [0, 16]";
    } else if (reinterpret_cast<std::uintptr_t>(dst) % 16 != 0 || reinterpret_cast<std::uintptr_t>(src) % 16 != 0) {
      error = "cp.async of 16 bytes: misaligned address (shared " +
              std::to_string(reinterpret_cast<std::uintptr_t>(dst) % 16) + " bytes past 16-byte alignment, global " +
              describe_pointer(src) + ")";
    } else if (!is_block_shared(w, dst, 16)) {
      error = "cp.async: the destination is not in the block's shared memory";
    } else if (src_bytes > 0 && !is_device_range(src, std::size_t(src_bytes))) {
      error = "cp.async: the source is not device memory: " + describe_pointer(src);
    }
  }
  if (!error.empty()) device_trap(error.c_str());
  if (src_bytes > 0) std::memcpy(dst, src, std::size_t(src_bytes));
  if (src_bytes < 16) std::memset(static_cast<char*>(dst) + src_bytes, 0, std::size_t(16 - src_bytes));
}

void device_trap(const char* what) {
  const HarnessScope scope;
  Worker& w = *tls_worker;
  fault(w, std::string(what) + " in " + thread_name(*w.block, *w.current));
  throw AbortBlock{};
}

}  // namespace llmtrain_emu

unsigned __activemask() {
  using namespace llmtrain_emu;
  const HarnessScope scope;
  Worker& w = *tls_worker;
  const int warp = w.current->linear / 32;
  return existing_lanes(w, warp) & ~exited_lanes(w, warp);
}

long long clock64() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
