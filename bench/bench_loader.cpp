// bench_loader: images/s of the data pipeline per decode thread.
//
// Generates ImageNet-sized JPEGs (500x375, textured, quality 90) in a temp
// folder, then measures
//   - one thread's time per image split into read, decode and transform,
//   - the Loader with 1 and 2 workers on the ImageNet training transforms
//     (RandomResizedCrop 224, flip, normalize) and the eval transforms,
//   - the Loader on Fashion-MNIST (IDX in memory, normalize only),
//   - torchvision's PIL pipeline on the same files (bench/loader_torchvision.py,
//     when python3 with torchvision or Pillow is installed).
//
//   bench_loader [--images 256] [--epochs 3]
#include <time.h>
#include <unistd.h>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <opencv2/imgcodecs.hpp>
#include <string>

#include "core/cpu/isa.h"
#include "data/idx.h"
#include "data/image_folder.h"
#include "data/loader.h"

using namespace trainer;
using namespace trainer::data;
namespace fs = std::filesystem;

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// CPU seconds of this thread, or of the whole process: on a shared machine
// images per CPU second is the figure that does not depend on the load.
double cpu_seconds(clockid_t clock) {
  timespec ts;
  clock_gettime(clock, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

struct Rate {
  double wall = 0;  // images per second
  double cpu = 0;   // images per CPU second (all threads)
};

// Smooth colour waves, edges and noise: compresses like a photo (about
// 100 KB at quality 90), not like a flat test card.
cv::Mat textured_image(int index, int height, int width) {
  cv::Mat m(height, width, CV_8UC3);
  uint32_t state = 2654435761u * uint32_t(index + 1);
  auto noise = [&] {
    state = state * 1664525u + 1013904223u;
    return int(state >> 27) - 16;
  };
  double fx = 0.01 + 0.005 * (index % 7), fy = 0.013 + 0.004 * (index % 5);
  for (int y = 0; y < height; ++y) {
    cv::Vec3b* row = m.ptr<cv::Vec3b>(y);
    for (int x = 0; x < width; ++x) {
      double a = std::sin(x * fx + y * 0.002 * index), b = std::cos(y * fy - x * 0.003);
      int edge = ((x / 37 + y / 53 + index) % 3) * 25;
      for (int c = 0; c < 3; ++c) {
        double v = 128 + 70 * a * (c == 0 ? 1 : 0.5) + 50 * b * (c == 2 ? 1 : 0.3) + edge + noise();
        row[x][c] = cv::saturate_cast<uint8_t>(v);
      }
    }
  }
  return m;
}

size_t write_images(const fs::path& root, int count, int classes) {
  size_t bytes = 0;
  const std::vector<int> params = {cv::IMWRITE_JPEG_QUALITY, 90};
  for (int i = 0; i < count; ++i) {
    fs::path dir = root / cat("class", i % classes);
    fs::create_directories(dir);
    std::vector<uint8_t> jpeg;
    cv::imencode(".jpg", textured_image(i, 375, 500), jpeg, params);
    FILE* f = std::fopen((dir / cat("img", i, ".jpg")).c_str(), "wb");
    std::fwrite(jpeg.data(), 1, jpeg.size(), f);
    std::fclose(f);
    bytes += jpeg.size();
  }
  return bytes;
}

// The loader's rate over `epochs` epochs after one warm-up epoch.
Rate loader_rate(const Dataset& ds, const TransformOptions& t, int workers, int epochs,
                 int64_t batch) {
  DistributedSampler sampler(SamplerOptions{ds.size(), 0, 1, 1});
  LoaderOptions o{.batch_size = batch, .num_workers = workers, .prefetch_batches = 4};
  o.report_epochs = false;
  Loader loader(ds, ImageTransform(t, ds.channels()), sampler, o);
  Batch b;
  loader.start_epoch(0);
  while (loader.next(b)) {
  }
  int64_t images = 0;
  auto start = Clock::now();
  double cpu_start = cpu_seconds(CLOCK_PROCESS_CPUTIME_ID);
  for (int e = 1; e <= epochs; ++e) {
    loader.start_epoch(e);
    while (loader.next(b)) images += b.images.size(0);
  }
  return Rate{double(images) / seconds_since(start),
              double(images) / (cpu_seconds(CLOCK_PROCESS_CPUTIME_ID) - cpu_start)};
}

void print_rates(const Dataset& ds, const TransformOptions& t, int epochs, int64_t batch) {
  for (int workers : {1, 2}) {
    Rate r = loader_rate(ds, t, workers, epochs, batch);
    std::printf(
        "  Loader, %d worker(s): %.0f images/s wall (%.0f per thread), %.0f images per CPU "
        "second\n",
        workers, r.wall, r.wall / workers, r.cpu);
  }
}

void breakdown(const ImageFolder& folder, const ImageTransform& t) {
  double read = 0, decode = 0, transform = 0;
  std::vector<float> out(size_t(t.sample_numel()));
  for (int64_t i = 0; i < folder.size(); ++i) {
    double t0 = cpu_seconds(CLOCK_THREAD_CPUTIME_ID);
    std::vector<uint8_t> bytes = read_file(folder.path(i));
    double t1 = cpu_seconds(CLOCK_THREAD_CPUTIME_ID);
    DecodedImage img = decode_image(bytes, t.min_decode_side(), folder.path(i));
    double t2 = cpu_seconds(CLOCK_THREAD_CPUTIME_ID);
    t.apply(img, augment_key(0, 0, i), out.data());
    read += t1 - t0;
    decode += t2 - t1;
    transform += cpu_seconds(CLOCK_THREAD_CPUTIME_ID) - t2;
  }
  double n = double(folder.size()) / 1e3;
  std::printf(
      "  one thread, CPU ms per image: read %.3f, decode %.3f, transform %.3f -> %.0f images "
      "per CPU second\n",
      read / n, decode / n, transform / n, double(folder.size()) / (read + decode + transform));
}

}  // namespace

int main(int argc, char** argv) {
  int count = 256, epochs = 3;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--images")) count = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--epochs")) epochs = std::atoi(argv[i + 1]);
  }
  cv::setNumThreads(0);  // one thread per decode, as in the Loader
  fs::path dir = fs::temp_directory_path() / cat("trainer_bench_loader_", ::getpid());
  fs::path root = dir / "train";
  size_t bytes = write_images(root, count, 4);
  ImageFolder folder(root.string());
  std::printf("%s\n", cpu::describe_machine().c_str());
  std::printf("bench_loader: %d JPEGs of 500x375, quality 90, %.0f KB on average, in %s\n", count,
              double(bytes) / count / 1024, root.c_str());

  TransformOptions train{.mode = TransformMode::train, .size = 224};
  TransformOptions eval{.mode = TransformMode::eval, .size = 224, .resize = 256};
  std::printf("ImageNet train transforms (RandomResizedCrop 224, flip, normalize):\n");
  breakdown(folder, ImageTransform(train, 3));
  print_rates(folder, train, epochs, 32);
  std::printf("ImageNet eval transforms (Resize 256, CenterCrop 224, normalize):\n");
  breakdown(folder, ImageTransform(eval, 3));
  print_rates(folder, eval, epochs, 32);

  if (fs::exists(std::string(kFashionMnistDir) + "/train-images-idx3-ubyte.gz")) {
    MnistDataset fmnist = load_fashion_mnist(kFashionMnistDir, Split::train);
    TransformOptions plain{.mode = TransformMode::plain, .size = 28};
    plain.mean = {kFashionMnistMean};
    plain.std = {kFashionMnistStd};
    std::printf("Fashion-MNIST train (60000 images of 28x28, normalize):\n");
    print_rates(fmnist, plain, 1, 256);
  } else {
    std::printf("Fashion-MNIST: not installed (apt install dataset-fashion-mnist), skipped\n");
  }

  // The same files through torchvision's PIL pipeline, on one thread.
  // TRAINER_SOURCE_DIR, not __FILE__: ccache (base_dir) compiles with relative paths.
  fs::path script = fs::path(TRAINER_SOURCE_DIR) / "bench" / "loader_torchvision.py";
  if (fs::exists(script) && std::system("python3 -c 'import PIL' > /dev/null 2>&1") == 0) {
    std::printf("Python, same files, same train transforms:\n");
    std::fflush(stdout);
    std::string cmd = cat("python3 ", script.string(), " ", root.string(), " --epochs ", epochs);
    if (std::system(cmd.c_str()) != 0) std::printf("  (%s failed)\n", cmd.c_str());
  } else {
    std::printf("Python with torchvision or Pillow not found: no torchvision comparison\n");
  }
  fs::remove_all(dir);
  return 0;
}
