// Data inputs a hostile user or a broken disk would give the trainer (issue
// 38): a trainer state's data position far past the epoch, images too small
// to learn from, test images of another size than the training images, and
// a validation split with whole batches of bad files. Each is an `error:
// ...` naming the file with exit 1, or, for the bad validation files under
// data.bad_files: skip, a run that ends with its checkpoint.
#include <filesystem>
#include <nlohmann/json.hpp>
#include <opencv2/imgcodecs.hpp>

#include "data/idx.h"
#include "data/image_folder.h"
#include "tests/hardening.h"
#include "tests/process.h"
#include "tests/testing.h"
#include "trainer/checkpoint.h"

using namespace trainer;
using namespace trainer::testing;
using namespace trainer::testing::hardening;
namespace fs = std::filesystem;

namespace {

// One split's IDX images (all pixels 7) and labels (all 1) in dir.
void write_fmnist_split(const fs::path& dir, const char* split, uint32_t n, uint32_t h,
                        uint32_t w) {
  std::vector<uint8_t> images = idx_header(0x08, {n, h, w});
  images.resize(images.size() + size_t(n) * h * w, 7);
  std::vector<uint8_t> labels = idx_header(0x08, {n});
  labels.resize(labels.size() + n, 1);
  write_bytes(dir / cat(split, "-images-idx3-ubyte"), images);
  write_bytes(dir / cat(split, "-labels-idx1-ubyte"), labels);
}

void write_file(const fs::path& path, const std::vector<uint8_t>& bytes) {
  fs::create_directories(path.parent_path());
  write_bytes(path, bytes);
}

std::vector<uint8_t> jpeg_of(int height, int width) {
  cv::Mat pixels(height, width, CV_8UC3, cv::Scalar(10, 120, 200));
  std::vector<uint8_t> bytes;
  REQUIRE(cv::imencode(".jpg", pixels, bytes));
  return bytes;
}

// The small CNN on an image folder of 2 classes, 16x16 crops, micro-batches of 2.
std::vector<std::string> folder_args(const fs::path& root, std::vector<std::string> extra) {
  std::vector<std::string> a{"train",
                             kRecipes + "fmnist_cnn.yaml",
                             "output_dir=" + (root / "out").string(),
                             "data.name=image_folder",
                             "data.root=" + root.string(),
                             "data.bad_files=skip",
                             "model.in_channels=3",
                             "model.num_classes=2",
                             "data.image_size=16",
                             "data.workers=1",
                             "training.global_batch=2",
                             "training.threads=1"};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

}  // namespace

TEST_CASE("data hardening: a data position past the epoch's end is an error naming it",
          "[hardening][checkpoint]") {
  // The base run's checkpoint of step 4 stopped 512 samples into epoch 0 of
  // Fashion-MNIST's 60000. A position beyond the epoch used to read as "the
  // epoch is over" and go on in epoch 1.
  fs::path run = copy_of_base("position_past_epoch");
  const fs::path ckpt = step_dir(run, 4);
  const std::string state = trainer_state_file(ckpt.string());
  for (int64_t position : {int64_t(1) << 40, int64_t(60001)}) {
    INFO("position " << position);
    edit_state(ckpt, [&](nlohmann::json& j) { j["position"] = position; });
    require_error(run_trainer(mlp_args(run, {"training.steps=6", "--resume", "auto"})),
                  {state + ": \"position\" is " + cat(position), "must be in [0, 60000]",
                   "Resume from a checkpoint of this dataset"});
    CHECK(!fs::exists(step_dir(run, 6)));
  }
  // The epoch's very end is a position a run may stop at: it resumes in epoch 1.
  edit_state(ckpt, [](nlohmann::json& j) { j["position"] = 60000; });
  ProcessResult r =
      run_trainer(mlp_args(run, {"training.steps=5", "training.log_every=1", "--resume", "auto"}),
                  {.timeout_s = 120});
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK(r.output.find("(epoch 0, position 60000)") != std::string::npos);
  CHECK(r.output.find("epoch 1 step 5/5") != std::string::npos);
}

TEST_CASE("data hardening: IDX images and model inputs too small to learn from are refused",
          "[hardening][data][idx]") {
  const fs::path dir = fresh_temp_dir("hardening_idx_small");
  // 1x1 images were upsampled to the model's 28x28: flat squares.
  write_fmnist(dir / "one", 4, 1, 1);
  CHECK_THAT(
      error_of([&] { data::load_fashion_mnist((dir / "one").string(), data::Split::train); }),
      Catch::Contains("train-images-idx3-ubyte: images [4, 1, 1] (count, height, width) are too "
                      "small to train on: expected each side at least 8 pixels"));
  write_fmnist(dir / "narrow", 4, 28, 7);
  CHECK_THAT(
      error_of([&] { data::load_fashion_mnist((dir / "narrow").string(), data::Split::val); }),
      Catch::Contains("t10k-images-idx3-ubyte: images [4, 28, 7] (count, height, width) are too "
                      "small to test on"));
  // The smallest accepted.
  write_fmnist(dir / "eight", 4, 8, 8);
  CHECK(data::load_fashion_mnist((dir / "eight").string(), data::Split::train).size() == 4);
  // So is a model input that small, whatever the files hold.
  require_error(run_trainer(mlp_args(fresh_temp_dir("hardening_image_size_run", false),
                                     {"training.steps=1", "data.image_size=1"})),
                {"fmnist_mlp.yaml: data.image_size 1 is too small", "expected at least 8"});
  // The trainer says so and exits 1.
  require_error(run_trainer(mlp_args(fresh_temp_dir("hardening_idx_small_run", false),
                                     {"training.steps=1", "data.root=" + (dir / "one").string()})),
                {(dir / "one" / "train-images-idx3-ubyte").string() + ": images [4, 1, 1]",
                 "expected each side at least 8 pixels"});
}

TEST_CASE("data hardening: IDX test images of another size than the training images are refused",
          "[hardening][data][idx]") {
  const fs::path dir = fresh_temp_dir("hardening_idx_sizes");
  write_fmnist_split(dir, "train", 4, 28, 28);
  write_fmnist_split(dir, "t10k", 3, 14, 14);
  const data::MnistDataset train = data::load_fashion_mnist(dir.string(), data::Split::train);
  const data::MnistDataset val = data::load_fashion_mnist(dir.string(), data::Split::val);
  const std::string train_file = (dir / "train-images-idx3-ubyte").string();
  const std::string test_file = (dir / "t10k-images-idx3-ubyte").string();
  CHECK_THAT(
      error_of([&] { data::check_same_image_size(train, val); }),
      Catch::Contains(test_file + ": test images [3, 14, 14] (count, height, width) " +
                      "differ in size from the training images of " + train_file + " [4, 28, 28]"));
  // Resized to data.image_size, they trained and evaluated as if nothing were wrong.
  require_error(run_trainer(mlp_args(fresh_temp_dir("hardening_idx_sizes_run", false),
                                     {"training.steps=1", "data.root=" + dir.string()})),
                {test_file + ": test images [3, 14, 14]", train_file + " [4, 28, 28]",
                 "expected test images of the training images' size"});
  // Same sizes, other counts: accepted.
  write_fmnist_split(dir, "t10k", 3, 28, 28);
  data::check_same_image_size(train, data::load_fashion_mnist(dir.string(), data::Split::val));
}

TEST_CASE("data hardening: an image folder's images too small to learn from are bad files",
          "[hardening][data][folder]") {
  const fs::path root = fresh_temp_dir("hardening_folder_small");
  write_file(root / "a" / "tiny.jpg", jpeg_of(1, 1));
  write_file(root / "a" / "thin.jpg", jpeg_of(40, 4));
  write_file(root / "a" / "fine.jpg", jpeg_of(8, 8));
  data::ImageFolder folder(root.string());
  REQUIRE(folder.size() == 3);
  CHECK(folder.load(0, 0).pixels.rows == 8);  // fine.jpg
  REQUIRE_THROWS_AS(folder.load(1, 0), data::BadSampleError);
  CHECK_THAT(error_of([&] { folder.load(1, 0); }),
             Catch::Contains("thin.jpg: an image 4 pixels wide and 40 high, too small to learn "
                             "from: images need each side at least 8 pixels"));
  CHECK_THAT(error_of([&] { folder.load(2, 0); }),
             Catch::Contains("tiny.jpg: an image 1 pixels wide and 1 high"));
}

TEST_CASE("data hardening: bad validation files are skipped and counted, the run checkpoints",
          "[hardening][data][folder]") {
  // Under bad_files: skip, a validation batch of bad files only (micro-batches
  // of 2, read in order: a/0 and a/1) ended a finished run with exit 1 and no
  // final checkpoint.
  const fs::path root = fresh_temp_dir("hardening_bad_val");
  const std::vector<uint8_t> good = jpeg_of(20, 20);
  for (const char* label : {"a", "b"})
    for (int i = 0; i < 3; ++i) {
      write_file(root / "train" / label / cat(i, ".jpg"), good);
      write_text(root / "val" / label / cat(i, ".jpg"), "junk");
    }
  for (int i = 0; i < 3; ++i) write_file(root / "val" / "b" / cat(i, ".jpg"), good);
  ProcessResult r = run_trainer(folder_args(root, {"training.steps=2", "training.eval_every=1"}),
                                {.timeout_s = 120});
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK(r.output.find("eval step 2: loss ") != std::string::npos);
  CHECK(r.output.find("| 3 bad files skipped | 3 samples") != std::string::npos);
  // Each bad file is named once, in the first evaluation's warnings.
  size_t named = 0;
  for (size_t at = 0; (at = r.output.find("val/a/0.jpg", at)) != std::string::npos; ++at) ++named;
  CHECK(named == 1);
  CHECK(CheckpointDir::is_complete(step_dir(root / "out", 2).string()));

  // Every validation file bad: nothing to evaluate, no best checkpoint, and
  // still the final checkpoint.
  for (int i = 0; i < 3; ++i) write_text(root / "val" / "b" / cat(i, ".jpg"), "junk");
  fs::remove_all(root / "out");
  r = run_trainer(folder_args(root, {"training.steps=2"}), {.timeout_s = 120});
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK(r.output.find("eval step 2: nothing evaluated: all 6 validation files read were bad and "
                      "skipped") != std::string::npos);
  CHECK(r.output.find("(best)") == std::string::npos);
  CHECK(r.output.find("final eval: nothing evaluated (6 bad files skipped);") != std::string::npos);
  CHECK(CheckpointDir::is_complete(step_dir(root / "out", 2).string()));

  // Under bad_files: error they stop the run, naming the file.
  fs::remove_all(root / "out");
  require_error(run_trainer(folder_args(root, {"training.steps=2", "data.bad_files=error"}),
                            {.timeout_s = 120}),
                {"val/a/0.jpg", "not a decodable image"});
}
