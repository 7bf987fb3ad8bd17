// How many threads a host-side parallel loop on a step's critical path may use (the logits'
// copy to the caller, the sampler's scans, drawing tokens for a batch's rows, n-gram lookup).
//
// OpenMP's default team is every core. Under tensor parallelism other threads keep some cores
// busy while those loops run: each follower rank's thread spins in its stream wait, and NCCL
// runs service threads per rank. A full team then oversubscribes the machine, and a loop with
// a barrier at its end waits for whichever of its threads the OS has descheduled — a scheduler
// time slice, milliseconds. Measured on two H200s (32 cores), Qwen3-30B-A3B shape, TP = 2: a
// step whose logits come to the host took 8.5 ms at batch 1 against 3.2 ms for the same step
// sampled on the GPU, and 20.0 / 60.6 ms (graphs on / off) against 15.6 at 64 x 4k; with a
// team of 4 threads (OMP_NUM_THREADS=4), 3.2 and 17.6 ms: 4 threads copied the 39 MB of
// logits in ~2 ms. So these loops take a small team, at most kMaxTeam threads less the cores
// reserved by whoever runs the spinning threads (TensorParallelRunner): a handful of busy
// threads can no longer take a core from a member of the team.
#pragma once

namespace kvlm::host_threads {

inline constexpr int kMaxTeam = 8;

// The team for such a loop: OpenMP's maximum less the reserved cores, between 1 and kMaxTeam.
int team();

// Cores that threads outside OpenMP keep busy, held while the object lives.
class Reservation {
 public:
  explicit Reservation(int cores);
  ~Reservation();
  Reservation(const Reservation&) = delete;
  Reservation& operator=(const Reservation&) = delete;

 private:
  int cores_;
};

}  // namespace kvlm::host_threads
