// The OpenMPI side of a benchmark that alternates its measurements with
// ours (bench/bench_alltoall.cpp): an MPI program under mpirun in --serve
// mode, which times one size per request, so each size is measured by both
// sides within a second of each other. Rank r of the MPI job reads sizes, one
// per line, from the FIFO DIR/size.r and rank 0 answers "bytes microseconds"
// on its stdout; a 0 ends it. Without MPI (or when it fails to start) time()
// returns a negative number.
//
//   MpiServer server(TRAINER_MPI_ALLTOALL, 2, max_bytes, /*bind=*/true);
//   double us = server.time(bytes);   // < 0: no OpenMPI
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "core/check.h"

namespace trainer::bench {

class MpiServer {
 public:
  // program: the MPI benchmark (null: none); bind: mpirun --bind-to core, else none.
  MpiServer(const char* mpiexec, const char* program, int ranks, size_t max_bytes, bool bind) {
    if (!mpiexec || !program) return;
    char dir[] = "/tmp/bench_mpi.XXXXXX";
    if (!::mkdtemp(dir)) return;
    dir_ = dir;
    for (int r = 0; r < ranks; ++r) {
      paths_.push_back(cat(dir_, "/size.", r));
      if (::mkfifo(paths_.back().c_str(), 0600) != 0) return;
    }
    const std::string command = cat(mpiexec, " --allow-run-as-root --oversubscribe --bind-to ",
                                    bind ? "core:overload-allowed" : "none", " -np ", ranks, " ",
                                    program, " --serve ", dir_, " ", max_bytes, " 2>/dev/null");
    out_ = ::popen(command.c_str(), "r");
    if (!out_) return;
    // Each rank opens its FIFO after MPI_Init: wait for every reader (up to
    // a minute; opening without a reader fails with ENXIO).
    for (const std::string& fifo : paths_) {
      int fd = -1;
      for (int tries = 0; fd < 0 && tries < 6000; ++tries) {
        fd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
        if (fd < 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      if (fd < 0) return;
      ::fcntl(fd, F_SETFL, 0);  // blocking writes from here on
      fifos_.push_back(fd);
    }
    ok_ = true;
  }
  ~MpiServer() {
    for (int fd : fifos_) {
      if (ok_) (void)!::write(fd, "0\n", 2);
      ::close(fd);
    }
    if (out_) ::pclose(out_);
    for (const std::string& fifo : paths_) ::unlink(fifo.c_str());
    if (!dir_.empty()) ::rmdir(dir_.c_str());
  }
  MpiServer(const MpiServer&) = delete;
  MpiServer& operator=(const MpiServer&) = delete;

  // OpenMPI's time for one operation on bytes (the slowest rank's mean), in us.
  double time(size_t bytes) {
    if (!ok_) return -1;
    const std::string request = cat(bytes, "\n");
    for (int fd : fifos_)
      if (::write(fd, request.data(), request.size()) != ssize_t(request.size())) ok_ = false;
    size_t got = 0;
    double us = -1;
    if (!ok_ || std::fscanf(out_, "%zu %lf", &got, &us) != 2 || got != bytes) ok_ = false;
    return ok_ ? us : -1;
  }

 private:
  std::string dir_;
  std::vector<std::string> paths_;  // the FIFO of each rank, in dir_
  FILE* out_ = nullptr;
  std::vector<int> fifos_;
  bool ok_ = false;
};

}  // namespace trainer::bench
