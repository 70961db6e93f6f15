// What the files of the checkpoint code share (checkpoint.cpp: the
// checkpoint directory, its files and their tensors; checkpoint_state.cpp:
// trainer_state.json; checkpoint_optimizer.cpp: the ZeRO-1 shards of the
// optimizer state; checkpoint_pieces.cpp: every rank's pieces;
// checkpoint_tool.cpp: the checkpoint commands). Not for other callers: trainer/checkpoint.h is the
// interface.
#pragma once

#include <filesystem>
#include <map>
#include <string>

#include "core/check.h"
#include "trainer/checkpoint.h"

namespace trainer {

// fs::status without its exceptions: absent is file_type::not_found, a
// symlink loop or an unreadable path an Error naming it.
std::filesystem::file_status status_of(const std::filesystem::path& path);

// Runs f, turning the std::filesystem errors of a checkpoint directory's
// upkeep into an Error naming the path and what to do.
template <class F>
auto checked_fs(const std::string& root, F f) -> decltype(f()) {
  try {
    return f();
  } catch (const std::filesystem::filesystem_error& e) {
    throw Error(cat("checkpoints in ", root, ": ", e.what(),
                    "; make sure the checkpoint directory is writable and holds no broken "
                    "links, or choose another output_dir"));
  }
}

// The ZeRO-1 shard files of a checkpoint, by rank. When its
// trainer_state.json records the layout that wrote it, they are exactly one
// per rank of that world: a file of a rank beyond it (left by another run,
// or copied in) would be joined into the state or silently ignored, and a
// missing one leaves a hole; either is an Error naming the file.
std::map<int, std::string> shard_files(const std::string& dir);

// The <stem>-rank<r>.safetensors files of dir, by rank.
std::map<int, std::string> pieces_files(const std::string& dir, const std::string& stem);
// Error naming path unless its metadata marks a file of pieces.
void require_pieces_file(const std::map<std::string, std::string>& metadata,
                         const std::string& path);
// The piece that tensor `key` (of `shape`) of a file of pieces holds, from
// the file's metadata (a whole tensor when it has no description); its
// values are left undefined.
TensorPiece piece_in_header(const std::string& key, const Shape& shape,
                            const std::map<std::string, std::string>& metadata,
                            const std::string& path);

}  // namespace trainer
