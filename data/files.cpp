// Checked file reads and directory creation; see files.h.
#include "data/files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

namespace trainer::data {

namespace {

const char* kind_of(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

[[noreturn]] void refuse(const std::string& path, const std::string& what, const char* kind) {
  throw Error(cat(path, ": ", what, " must be a regular file, but this is ", kind,
                  "; give the path of a regular file"));
}

[[noreturn]] void cannot_open(const std::string& path, const std::string& what, int err) {
  throw Error(cat("cannot open ", what, " ", path, ": ", std::strerror(err),
                  err == ELOOP ? " (a symlink loop: fix or remove the link)" : ""));
}

}  // namespace

RegularFile::RegularFile(const std::string& path, const std::string& what) : path_(path) {
  // stat first: opening a FIFO for reading would wait for a writer.
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) cannot_open(path, what, errno);
  if (!S_ISREG(st.st_mode)) refuse(path, what, kind_of(st.st_mode));
  // O_NONBLOCK in case it was swapped for a FIFO since; fstat says what was opened.
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd_ < 0) cannot_open(path, what, errno);
  if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode)) {
    const mode_t mode = st.st_mode;
    ::close(fd_);
    refuse(path, what, kind_of(mode));
  }
  ::fcntl(fd_, F_SETFL, ::fcntl(fd_, F_GETFL) & ~O_NONBLOCK);
  size_ = uint64_t(st.st_size);
}

RegularFile::~RegularFile() {
  if (fd_ >= 0) ::close(fd_);
}

int RegularFile::release() {
  int fd = fd_;
  fd_ = -1;
  return fd;
}

void RegularFile::read_exactly(void* dst, uint64_t n) {
  uint64_t done = 0;
  while (done < n) {
    ssize_t got = ::read(fd_, static_cast<char*>(dst) + done, size_t(n - done));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) throw Error(cat("cannot read ", path_, ": ", std::strerror(errno)));
    if (got == 0)
      throw Error(cat(path_, ": the file ended after ", done, " of ", n,
                      " bytes (was it changed while being read?)"));
    done += uint64_t(got);
  }
}

namespace {

template <class Bytes>
Bytes read_whole(const std::string& path, const std::string& what, uint64_t max_bytes) {
  RegularFile file(path, what);
  if (file.size() > max_bytes)
    throw Error(cat(path, ": ", what, " is ", file.size(), " bytes, more than the ", max_bytes,
                    " bytes accepted; is this the right file?"));
  Bytes bytes(size_t(file.size()), 0);
  file.read_exactly(bytes.data(), file.size());
  return bytes;
}

}  // namespace

std::string read_regular_file(const std::string& path, const std::string& what,
                              uint64_t max_bytes) {
  return read_whole<std::string>(path, what, max_bytes);
}

std::vector<uint8_t> read_regular_file_bytes(const std::string& path, const std::string& what,
                                             uint64_t max_bytes) {
  return read_whole<std::vector<uint8_t>>(path, what, max_bytes);
}

LineChunks::LineChunks(const std::string& path, const std::string& what, size_t chunk_bytes)
    : file_(path, what), path_(path), chunk_bytes_(chunk_bytes) {}

bool LineChunks::next(std::string& chunk) {
  chunk = std::move(carry_);
  carry_.clear();
  size_t searched = 0;  // chunk[0, searched) holds no line break
  while (true) {
    if (chunk.size() >= chunk_bytes_) {
      const size_t found = std::string_view(chunk).substr(searched).rfind('\n');
      if (found != std::string_view::npos) {
        carry_.assign(chunk, searched + found + 1);
        chunk.resize(searched + found + 1);
        return true;
      }
      searched = chunk.size();  // one long line so far: read on
    }
    if (eof_) return !chunk.empty();
    const size_t old = chunk.size();
    chunk.resize(old + chunk_bytes_);
    ssize_t got;
    do got = ::read(file_.fd(), chunk.data() + old, chunk_bytes_);
    while (got < 0 && errno == EINTR);
    if (got < 0) throw Error(cat("cannot read ", path_, ": ", std::strerror(errno)));
    chunk.resize(old + size_t(got));
    eof_ = got == 0;
  }
}

namespace {

[[noreturn]] void cannot_write(const std::string& path, const char* what) {
  throw Error(cat("cannot ", what, " ", path, ": ", std::strerror(errno),
                  "; check that its directory exists and is writable and the disk has room"));
}

}  // namespace

AtomicFile::AtomicFile(std::string path) : path_(std::move(path)), temp_(path_ + ".tmp") {
  fd_ = ::open(temp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) cannot_write(temp_, "create");
}

AtomicFile::~AtomicFile() {
  if (fd_ < 0) return;
  ::close(fd_);
  ::unlink(temp_.c_str());
}

void AtomicFile::write(const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t put = ::write(fd_, p, n);
    if (put < 0 && errno == EINTR) continue;
    if (put <= 0) cannot_write(temp_, "write");
    p += put, n -= size_t(put);
  }
}

void AtomicFile::write_at(uint64_t offset, const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t put = ::pwrite(fd_, p, n, off_t(offset));
    if (put < 0 && errno == EINTR) continue;
    if (put <= 0) cannot_write(temp_, "write");
    p += put, n -= size_t(put), offset += uint64_t(put);
  }
}

void AtomicFile::commit() {
  CHECK(fd_ >= 0) << path_ << " committed twice";
  if (::fsync(fd_) != 0) cannot_write(temp_, "sync");
  ::close(fd_);
  fd_ = -1;
  if (::rename(temp_.c_str(), path_.c_str()) != 0) {
    const int err = errno;
    ::unlink(temp_.c_str());
    errno = err;
    cannot_write(path_, "rename the finished file to");
  }
}

void write_file_atomically(const std::string& path, std::string_view bytes) {
  AtomicFile file(path);
  file.write(bytes.data(), bytes.size());
  file.commit();
}

std::string not_a_regular_file(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return std::strerror(errno);
  if (!S_ISREG(st.st_mode)) return cat("is ", kind_of(st.st_mode));
  return "";
}

void make_directories(const std::string& path, const std::string& what) {
  if (path.empty())
    throw Error(
        cat(what, " is empty; set it to the directory to write into, e.g. ", what, "=runs/x"));
  std::error_code ec;
  std::filesystem::create_directories(path, ec);
  if (!ec && std::filesystem::is_directory(path, ec)) return;
  const std::string reason = ec ? ec.message() : std::string("a file of that name is in the way");
  throw Error(cat("cannot create the directory ", path, " (", what, "): ", reason,
                  "; choose a writable directory for ", what,
                  " (no file of that name, none on its path)"));
}

}  // namespace trainer::data
