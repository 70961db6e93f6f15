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
// Single runs on a shared VM swing by 30%, so the ImageNet rows are measured
// in --rounds rounds (default 3), each ours and then the Python pipeline;
// every round is printed, then each side's median and "ours / Python" as the
// median of the per-round ratios with their range, e.g. "1.42x (1.31-1.55)".
// The distance to the limit: each row's output, the decoded f32 tensor
// bytes it produces per CPU second, as a fraction of the single-thread
// memcpy bandwidth measured at start ("of copy").
//
//   bench_loader [--images 256] [--epochs 3] [--rounds 3]
#include <time.h>
#include <unistd.h>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <opencv2/imgcodecs.hpp>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "core/cpu/isa.h"
#include "data/idx.h"
#include "data/image_folder.h"
#include "data/loader.h"

using namespace trainer;
using namespace trainer::data;
using trainer::bench::Spread;
using trainer::bench::spread_of;
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

// Single-thread memcpy bandwidth in GB/s: 256 MiB, far past the last-level
// cache, best of 5. The bound a pipeline that writes its output once cannot
// pass per thread.
double memcpy_bandwidth() {
  const size_t bytes = size_t(256) << 20;
  std::vector<char> a(bytes, 1), b(bytes, 2);
  double best = 1e30;
  for (int rep = 0; rep < 5; ++rep) {
    auto start = Clock::now();
    std::memcpy(rep % 2 ? a.data() : b.data(), rep % 2 ? b.data() : a.data(), bytes);
    best = std::min(best, seconds_since(start));
  }
  return double(bytes) / best / 1e9;
}

// One thread's CPU seconds spent reading, decoding and transforming `images` images.
struct Breakdown {
  double read = 0, decode = 0, transform = 0;
  int64_t images = 0;
  double per_cpu_second() const { return double(images) / (read + decode + transform); }
};

// Every file of the folder `epochs` times through read, decode and transform on this thread.
Breakdown breakdown(const ImageFolder& folder, const ImageTransform& t, int epochs) {
  Breakdown b;
  std::vector<float> out(size_t(t.sample_numel()));
  for (int e = 0; e < epochs; ++e)
    for (int64_t i = 0; i < folder.size(); ++i) {
      double t0 = cpu_seconds(CLOCK_THREAD_CPUTIME_ID);
      std::vector<uint8_t> bytes = read_file(folder.path(i));
      double t1 = cpu_seconds(CLOCK_THREAD_CPUTIME_ID);
      const PhiloxKey key = augment_key(t.options().seed, e, i);
      DecodedImage img = decode_image(bytes, t.decode_hint(key), folder.path(i));
      double t2 = cpu_seconds(CLOCK_THREAD_CPUTIME_ID);
      t.apply(img, key, out.data());
      b.read += t1 - t0;
      b.decode += t2 - t1;
      b.transform += cpu_seconds(CLOCK_THREAD_CPUTIME_ID) - t2;
      ++b.images;
    }
  return b;
}

// The Python pipeline's rate (bench/loader_torchvision.py), from its line
// "  NAME, 1 thread: W images/s wall, C images per CPU second (N images)".
struct PeerRate {
  std::string name;
  Rate rate;
  long images = 0;
};

bool run_peer(const std::string& command, PeerRate& peer) {
  FILE* pipe = popen(command.c_str(), "r");
  if (!pipe) return false;
  bool found = false;
  char line[512];
  while (std::fgets(line, sizeof line, pipe)) {
    const char* mark = std::strstr(line, ", 1 thread: ");
    if (!mark || found) continue;
    found = std::sscanf(mark, ", 1 thread: %lf images/s wall, %lf images per CPU second (%ld",
                        &peer.rate.wall, &peer.rate.cpu, &peer.images) == 3;
    const char* name = line + std::strspn(line, " ");
    peer.name.assign(name, size_t(mark - name));
  }
  return pclose(pipe) == 0 && found;
}

// What a set of transforms is measured with: how many passes over the
// files, the rounds, and (train transforms) the Python pipeline to alternate with.
struct Protocol {
  int epochs = 3;
  int rounds = 3;
  double copy_gbps = 0;      // the copy bound
  std::string peer_command;  // empty: no peer
};

// One round of ours: one thread, and the Loader with 1 and 2 workers.
struct OursRound {
  Breakdown one_thread;
  Rate workers[2];
};

// " output X GB/s = F of copy": decoded f32 tensor bytes per CPU second
// against the single-thread copy bound.
std::string output_share(double images_per_cpu_second, int64_t sample_numel, double copy_gbps) {
  const double gbps = images_per_cpu_second * double(sample_numel) * sizeof(float) / 1e9;
  char text[64];
  std::snprintf(text, sizeof text, "; output %.3f GB/s = %.4f of copy", gbps, gbps / copy_gbps);
  return text;
}

// Each side's median over the rounds, then ours / the peer's images per CPU
// second as the median of the per-round ratios and their range.
void print_medians(const std::vector<OursRound>& ours, const std::vector<PeerRate>& peers,
                   int64_t sample_numel, double copy_gbps) {
  auto median_of = [&](auto field) {
    std::vector<double> v;
    for (const OursRound& r : ours) v.push_back(field(r));
    return spread_of(v).median;
  };
  const double read = median_of([](const OursRound& r) { return r.one_thread.read; });
  const double decode = median_of([](const OursRound& r) { return r.one_thread.decode; });
  const double transform = median_of([](const OursRound& r) { return r.one_thread.transform; });
  const double one = median_of([](const OursRound& r) { return r.one_thread.per_cpu_second(); });
  const double n = double(ours[0].one_thread.images) / 1e3;
  std::printf(
      "  one thread, CPU ms per image: read %.3f, decode %.3f, transform %.3f -> %.0f images "
      "per CPU second%s\n",
      read / n, decode / n, transform / n, one, output_share(one, sample_numel, copy_gbps).c_str());
  for (int w = 0; w < 2; ++w) {
    const double wall = median_of([w](const OursRound& r) { return r.workers[w].wall; });
    const double cpu = median_of([w](const OursRound& r) { return r.workers[w].cpu; });
    std::printf(
        "  Loader, %d worker(s): %.0f images/s wall (%.0f per thread), %.0f images per CPU "
        "second%s\n",
        w + 1, wall, wall / (w + 1), cpu, output_share(cpu, sample_numel, copy_gbps).c_str());
  }
  if (peers.empty()) return;
  std::vector<double> wall, cpu, one_ratio, loader_ratio;
  for (size_t k = 0; k < peers.size(); ++k) {
    wall.push_back(peers[k].rate.wall);
    cpu.push_back(peers[k].rate.cpu);
    one_ratio.push_back(ours[k].one_thread.per_cpu_second() / peers[k].rate.cpu);
    loader_ratio.push_back(ours[k].workers[0].cpu / peers[k].rate.cpu);
  }
  const double peer_cpu = spread_of(cpu).median;
  std::printf("Python, same files, same train transforms:\n");
  std::printf("  %s, 1 thread: %.0f images/s wall, %.0f images per CPU second%s\n",
              peers[0].name.c_str(), spread_of(wall).median, peer_cpu,
              output_share(peer_cpu, sample_numel, copy_gbps).c_str());
  const Spread one_spread = spread_of(one_ratio), loader_spread = spread_of(loader_ratio);
  std::printf(
      "  ours / Python, images per CPU second, median of %zu rounds (range): one thread "
      "%.2fx (%.2f-%.2f), Loader 1 worker %.2fx (%.2f-%.2f)\n",
      peers.size(), one_spread.median, one_spread.low, one_spread.high, loader_spread.median,
      loader_spread.low, loader_spread.high);
}

// `rounds` rounds, each ours (one thread, Loader with 1 and 2 workers) and
// then the peer's pipeline when there is one, so a slow spell of the machine
// touches both sides; every round printed, then the medians.
void measure_transforms(const ImageFolder& folder, const TransformOptions& options,
                        const Protocol& protocol) {
  const ImageTransform transform(options, 3);
  std::vector<OursRound> ours;
  std::vector<PeerRate> peers;
  bool peer_ok = !protocol.peer_command.empty();
  for (int k = 0; k < protocol.rounds; ++k) {
    OursRound r;
    r.one_thread = breakdown(folder, transform, protocol.epochs);
    for (int w = 0; w < 2; ++w)
      r.workers[w] = loader_rate(folder, options, w + 1, protocol.epochs, 32);
    ours.push_back(r);
    std::printf("  round %d: ours one thread %.0f, Loader 1 worker %.0f, 2 workers %.0f", k + 1,
                r.one_thread.per_cpu_second(), r.workers[0].cpu, r.workers[1].cpu);
    PeerRate peer;
    if (peer_ok && (peer_ok = run_peer(protocol.peer_command, peer))) {
      peers.push_back(peer);
      std::printf("; Python %.0f", peer.rate.cpu);
    }
    std::printf(" images per CPU second\n");
    std::fflush(stdout);
  }
  if (!protocol.peer_command.empty() && !peer_ok) {
    std::printf("  (%s failed: no Python comparison)\n", protocol.peer_command.c_str());
    peers.clear();
  }
  std::printf("  medians of %d round%s:\n", protocol.rounds, protocol.rounds == 1 ? "" : "s");
  print_medians(ours, peers, transform.sample_numel(), protocol.copy_gbps);
}

void usage() {
  std::fprintf(stderr, "usage: bench_loader [--images N] [--epochs N] [--rounds N]\n");
}

}  // namespace

int main(int argc, char** argv) {
  int count = 256;
  Protocol protocol;
  for (int i = 1; i < argc; i += 2) {
    const std::string option = argv[i];
    if (i + 1 >= argc || !(option == "--images" || option == "--epochs" || option == "--rounds")) {
      usage();
      return 2;
    }
    const int value = std::max(1, std::atoi(argv[i + 1]));
    (option == "--images"   ? count
     : option == "--epochs" ? protocol.epochs
                            : protocol.rounds) = value;
  }
  cv::setNumThreads(0);  // one thread per decode, as in the Loader
  std::printf("%s\n", cpu::describe_machine().c_str());
  protocol.copy_gbps = memcpy_bandwidth();  // before the files: nothing else of ours runs
  fs::path dir = fs::temp_directory_path() / cat("trainer_bench_loader_", ::getpid());
  fs::path root = dir / "train";
  size_t bytes = write_images(root, count, 4);
  ImageFolder folder(root.string());
  std::printf("bench_loader: %d JPEGs of 500x375, quality 90, %.0f KB on average, in %s\n", count,
              double(bytes) / count / 1024, root.c_str());
  std::printf(
      "copy bound: single-thread memcpy %.2f GB/s (256 MiB, best of 5); output = the decoded "
      "f32 tensor bytes produced per CPU second (3x224x224x4 per image), of copy = output / "
      "copy bound\n",
      protocol.copy_gbps);

  // The same files through torchvision's PIL pipeline, on one thread.
  // TRAINER_SOURCE_DIR, not __FILE__: ccache (base_dir) compiles with relative paths.
  fs::path script = fs::path(TRAINER_SOURCE_DIR) / "bench" / "loader_torchvision.py";
  Protocol train_protocol = protocol;
  if (fs::exists(script) && std::system("python3 -c 'import PIL' > /dev/null 2>&1") == 0)
    train_protocol.peer_command =
        cat("python3 ", script.string(), " ", root.string(), " --epochs ", protocol.epochs);
  TransformOptions train{.mode = TransformMode::train, .size = 224};
  TransformOptions eval{.mode = TransformMode::eval, .size = 224, .resize = 256};
  std::printf(
      "ImageNet train transforms (RandomResizedCrop 224, flip, normalize), %d rounds of ours "
      "then %s:\n",
      protocol.rounds,
      train_protocol.peer_command.empty() ? "no peer (Python with torchvision or Pillow not found)"
                                          : "the Python pipeline");
  measure_transforms(folder, train, train_protocol);
  std::printf("ImageNet eval transforms (Resize 256, CenterCrop 224, normalize), %d rounds:\n",
              protocol.rounds);
  measure_transforms(folder, eval, protocol);

  if (fs::exists(std::string(kFashionMnistDir) + "/train-images-idx3-ubyte.gz")) {
    MnistDataset fmnist = load_fashion_mnist(kFashionMnistDir, Split::train);
    TransformOptions plain{.mode = TransformMode::plain, .size = 28};
    plain.mean = {kFashionMnistMean};
    plain.std = {kFashionMnistStd};
    std::printf("Fashion-MNIST train (60000 images of 28x28, normalize), one round:\n");
    const int64_t numel = ImageTransform(plain, 1).sample_numel();
    for (int workers : {1, 2}) {
      Rate r = loader_rate(fmnist, plain, workers, 1, 256);
      std::printf(
          "  Loader, %d worker(s): %.0f images/s wall (%.0f per thread), %.0f images per CPU "
          "second%s\n",
          workers, r.wall, r.wall / workers, r.cpu,
          output_share(r.cpu, numel, protocol.copy_gbps).c_str());
    }
  } else {
    std::printf("Fashion-MNIST: not installed (apt install dataset-fashion-mnist), skipped\n");
  }
  fs::remove_all(dir);
  return 0;
}
