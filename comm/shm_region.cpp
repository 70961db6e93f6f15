#include "comm/shm_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "core/check.h"

namespace trainer::comm {

namespace {
std::atomic<size_t> g_local_bytes{0};  // this process's parts of the live regions
}

ShmRegion::ShmRegion(uint64_t id, size_t bytes, int rank, int size)
    : id_(id), bytes_(bytes), rank_(rank), parts_(size_t(size), nullptr), fds_(size_t(size), -1) {
  g_local_bytes += bytes_;
}

ShmRegion::~ShmRegion() {
  g_local_bytes -= bytes_;
  for (auto [base, bytes] : side_by_side_) ::munmap(base, bytes);
  for (char* part : parts_)
    if (part) ::munmap(part, bytes_);
  for (int fd : fds_)
    if (fd >= 0) ::close(fd);
}

size_t ShmRegion::page_size() { return size_t(::sysconf(_SC_PAGESIZE)); }

const char* ShmRegion::map_side_by_side(size_t offset, size_t bytes) {
  const size_t page = page_size(), n = parts_.size();
  CHECK(offset % page == 0 && bytes % page == 0 && bytes > 0 && offset + bytes <= bytes_)
      << "map_side_by_side: [" << offset << ", +" << bytes << ") of a part of " << bytes_
      << " bytes, in pages of " << page;
  // Address space for all the blocks, then each rank's block mapped over its place.
  void* base =
      ::mmap(nullptr, n * bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED) return nullptr;
  char* at = static_cast<char*>(base);
  for (size_t r = 0; r < n; ++r)
    if (fds_[r] < 0 || ::mmap(at + r * bytes, bytes, PROT_READ, MAP_SHARED | MAP_FIXED, fds_[r],
                              off_t(offset)) == MAP_FAILED) {
      ::munmap(base, n * bytes);
      return nullptr;
    }
  side_by_side_.emplace_back(at, n * bytes);
  return at;
}

size_t ShmRegion::local_bytes_in_use() { return g_local_bytes.load(); }

bool ShmRegion::contains(const void* data, size_t bytes) const {
  const char* p = static_cast<const char*>(data);
  return p >= local() && bytes <= bytes_ && size_t(p - local()) <= bytes_ - bytes;
}

std::shared_ptr<ShmRegion> ShmRegion::create(Store& store, const std::vector<long>& pids, int rank,
                                             const std::string& key, uint64_t id, size_t bytes,
                                             std::string* why) {
  const int n = int(pids.size());
  CHECK(bytes > 0 && rank >= 0 && rank < n)
      << "shared region of " << bytes << " bytes, rank " << rank << " of " << n;
  std::shared_ptr<ShmRegion> region(new ShmRegion(id, bytes, rank, n));
  // This rank's part: a memfd the peers open through /proc.
  int fd = ::memfd_create("trainer-shared-region", MFD_CLOEXEC);
  if (fd >= 0 && ::ftruncate(fd, off_t(bytes)) != 0) {
    *why = cat("cannot size a memfd to ", bytes, " bytes: ", std::strerror(errno));
    ::close(fd);
    fd = -1;
  } else if (fd < 0) {
    *why = cat("memfd_create: ", std::strerror(errno));
  }
  store.set(cat(key, "fd/", rank), fd >= 0 ? cat(fd) : std::string());
  store.barrier(key + "created", n);
  for (int r = 0; r < n && why->empty(); ++r) {
    const std::string theirs = r == rank ? cat(fd) : store.get(cat(key, "fd/", r));
    if (theirs.empty()) {
      *why = cat("rank ", r, " could not create its part");
      break;
    }
    const int part_fd = r == rank ? fd
                                  : ::open(cat("/proc/", pids[size_t(r)], "/fd/", theirs).c_str(),
                                           O_RDWR | O_CLOEXEC);
    if (part_fd < 0) {
      *why = cat("cannot open rank ", r, "'s part (/proc/", pids[size_t(r)], "/fd/", theirs,
                 "): ", std::strerror(errno));
      break;
    }
    void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, part_fd, 0);
    if (base == MAP_FAILED)
      *why = cat("cannot map rank ", r, "'s part: ", std::strerror(errno));
    else
      region->parts_[size_t(r)] = static_cast<char*>(base);
    region->fds_[size_t(r)] = part_fd;
  }
  // Every peer has opened this rank's memfd (or given up).
  store.barrier(key + "mapped", n);
  if (fd >= 0 && region->fds_[size_t(rank)] != fd) ::close(fd);
  if (!why->empty()) store.add(key + "failed", 1);
  store.barrier(key + "checked", n);
  if (store.add(key + "failed", 0) > 0) {
    if (why->empty()) *why = "another rank could not map every part";
    return nullptr;
  }
  return region;
}

}  // namespace trainer::comm
