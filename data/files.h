// Files read and directories made without crashing or hanging on what a
// user or the environment may put in their place. Every reader of a data
// file, a recipe or a checkpoint goes through here:
//
// - a FIFO, device, socket or directory where a file is expected is refused
//   before any read (stat, open with O_NONBLOCK so a FIFO cannot block,
//   fstat of what was opened), since a read from one blocks forever or
//   never ends;
// - the size read is the file's real size (fstat), checked against a limit
//   before anything is allocated;
// - a symlink loop, a path under a regular file, or a directory that cannot
//   be made is a trainer::Error naming the path and what to do, never a
//   std::filesystem exception.
//
//   std::string text = read_regular_file("recipes/x.yaml", "the recipe");
//   RegularFile file("data.idx.gz", "the IDX file");   // an open fd to hand to zlib
//   make_directories("runs/x", "output_dir");
//   write_file_atomically("out/tokenizer.model", bytes);   // temp file, fsync, rename
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/check.h"

namespace trainer::data {

// An open regular file (O_RDONLY | O_CLOEXEC, blocking reads restored).
// Throws Error naming the path and `what` it was meant to be when it is
// missing, unreadable, a symlink loop or not a regular file.
class RegularFile {
 public:
  RegularFile(const std::string& path, const std::string& what);
  ~RegularFile();
  RegularFile(const RegularFile&) = delete;
  RegularFile& operator=(const RegularFile&) = delete;

  uint64_t size() const { return size_; }
  int fd() const { return fd_; }
  // Gives up the descriptor (e.g. to gzdopen, which closes it).
  int release();
  // Reads exactly n bytes from the current offset into dst; Error naming the
  // path when the file ends early (it shrank) or a read fails.
  void read_exactly(void* dst, uint64_t n);

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;
};

// The largest file read whole into memory by default (checkpoint files and
// datasets may be large; the limit only stops a device or a sparse file
// from being slurped).
inline constexpr uint64_t kMaxFileBytes = uint64_t(1) << 40;

// The whole regular file; Error when it is larger than max_bytes.
std::string read_regular_file(const std::string& path, const std::string& what,
                              uint64_t max_bytes = kMaxFileBytes);
std::vector<uint8_t> read_regular_file_bytes(const std::string& path, const std::string& what,
                                             uint64_t max_bytes = kMaxFileBytes);

// A text file read in chunks of whole lines: each chunk about chunk_bytes
// long, ending with a line break (the file's last chunk may end without
// one; a longer line is one chunk of its own).
class LineChunks {
 public:
  LineChunks(const std::string& path, const std::string& what, size_t chunk_bytes = 1 << 20);
  uint64_t size() const { return file_.size(); }
  // The next chunk into `chunk`; false at the end of the file.
  bool next(std::string& chunk);

 private:
  RegularFile file_;
  std::string path_;
  size_t chunk_bytes_;
  std::string carry_;  // read after the last line break so far
  bool eof_ = false;
};

// A file written whole or not at all: the bytes go to `path`.tmp, which
// commit() fsyncs and renames over `path`; destroyed uncommitted, the
// temporary file is removed. Errors name the path and say what failed.
class AtomicFile {
 public:
  explicit AtomicFile(std::string path);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  void write(const void* data, size_t n);
  // Overwrites bytes already written, at `offset` from the start.
  void write_at(uint64_t offset, const void* data, size_t n);
  void commit();

 private:
  std::string path_, temp_;
  int fd_ = -1;
};

// AtomicFile with these bytes.
void write_file_atomically(const std::string& path, std::string_view bytes);

// The reason path is not a regular file one can read ("is a FIFO",
// "does not exist", "Too many levels of symbolic links"), "" when it is.
std::string not_a_regular_file(const std::string& path);

// create_directories, with an Error naming the path and `what` it is (a
// recipe key such as "output_dir") for an empty path, a path under a file,
// a regular file in its place, a read-only or virtual file system.
void make_directories(const std::string& path, const std::string& what);

}  // namespace trainer::data
