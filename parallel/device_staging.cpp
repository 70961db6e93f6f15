#include "parallel/device_staging.h"

#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <thread>

namespace trainer::parallel {

namespace {

class HostCopier final : public BucketCopier {
 public:
  std::shared_ptr<void> ready(const Tensor&) override { return nullptr; }
  void to_host(const Tensor& flat, const std::shared_ptr<void>&, void* host) override {
    std::memcpy(host, flat.data_ptr(), flat.nbytes());
  }
  void from_host(const void* host, const Tensor& flat) override {
    std::memcpy(flat.data_ptr(), host, flat.nbytes());
  }
  std::shared_ptr<void> host_buffer(size_t bytes) override {
    return std::shared_ptr<void>(::operator new(bytes), [](void* p) { ::operator delete(p); });
  }
};

void finish_work(comm::Work::State& state, std::exception_ptr error) {
  std::lock_guard<std::mutex> lock(state.mutex);
  state.error = error;
  state.done = true;
  state.done_cv.notify_all();
}

// A FIFO handed from one thread to another; pop() returns false once closed and drained.
template <class T>
class Channel {
 public:
  void push(T item) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      items_.push_back(std::move(item));
    }
    cv_.notify_one();
  }
  bool pop(T& item) {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [&] { return closed_ || !items_.empty(); });
    if (items_.empty()) return false;
    item = std::move(items_.front());
    items_.pop_front();
    return true;
  }
  void close() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      closed_ = true;
    }
    cv_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<T> items_;
  bool closed_ = false;
};

// The pipeline behind staged_reduce: the issue thread copies a bucket to its
// staging buffer and starts its allreduce; the completion thread waits for
// the allreduce, copies the result back and finishes the bucket's Work.
class Stager {
 public:
  Stager(std::shared_ptr<BucketCopier> copier, DeviceStagingOptions options)
      : copier_(std::move(copier)), options_(options) {
    issue_thread_ = std::thread([this] { issue_loop(); });
    complete_thread_ = std::thread([this] { complete_loop(); });
  }
  ~Stager() {
    issue_.close();
    issue_thread_.join();
    complete_.close();
    complete_thread_.join();
  }
  Stager(const Stager&) = delete;
  Stager& operator=(const Stager&) = delete;

  // On the thread running backward.
  comm::Work reduce(comm::Communicator& comm, const Bucket& bucket) {
    CHECK(bucket.flat.is_contiguous()) << "staged_reduce: bucket " << bucket.index;
    Job job;
    job.comm = &comm;
    job.flat = bucket.flat;
    job.host = staging_buffer(bucket.index, bucket.flat.nbytes());
    job.ready = copier_->ready(bucket.flat);
    job.state = std::make_shared<comm::Work::State>();
    comm::Work work(job.state);
    issue_.push(std::move(job));
    return work;
  }

 private:
  struct Job {
    comm::Communicator* comm = nullptr;
    Tensor flat;
    std::shared_ptr<void> host, ready;
    std::shared_ptr<comm::Work::State> state;
    comm::Work allreduce;  // set by the issue thread
  };

  std::shared_ptr<void> staging_buffer(int index, size_t bytes) {
    std::shared_ptr<void>& b = buffers_[index];
    if (!b || buffer_bytes_[index] != bytes) {
      b = copier_->host_buffer(bytes);
      buffer_bytes_[index] = bytes;
    }
    return b;
  }

  void issue_loop() {
    Job job;
    while (issue_.pop(job)) {
      try {
        copier_->to_host(job.flat, job.ready, job.host.get());
        job.allreduce = comm::allreduce_async(*job.comm, job.host.get(), size_t(job.flat.numel()),
                                              job.flat.dtype(), options_.allreduce);
      } catch (...) {
        finish_work(*job.state, std::current_exception());
        continue;
      }
      complete_.push(std::move(job));
    }
  }

  void complete_loop() {
    Job job;
    while (complete_.pop(job)) {
      std::exception_ptr error;
      try {
        job.allreduce.wait();
        copier_->from_host(job.host.get(), job.flat);
      } catch (...) {
        error = std::current_exception();
      }
      finish_work(*job.state, error);
    }
  }

  std::shared_ptr<BucketCopier> copier_;
  DeviceStagingOptions options_;
  // Staging buffers by bucket index; only the backward thread touches them.
  std::map<int, std::shared_ptr<void>> buffers_;
  std::map<int, size_t> buffer_bytes_;
  Channel<Job> issue_, complete_;
  std::thread issue_thread_, complete_thread_;
};

}  // namespace

std::shared_ptr<BucketCopier> host_bucket_copier() { return std::make_shared<HostCopier>(); }

BucketReduceFn direct_reduce(std::shared_ptr<const comm::Reducer> reducer,
                             std::function<void(const Tensor& flat)> ready,
                             DeviceStagingOptions options) {
  CHECK(reducer) << "direct_reduce without a reducer";
  comm::AllreduceOptions allreduce = options.allreduce;
  allreduce.reducer = std::move(reducer);
  return [allreduce, ready = std::move(ready)](comm::Communicator& comm, const Bucket& bucket) {
    CHECK(bucket.flat.is_contiguous()) << "direct_reduce: bucket " << bucket.index;
    if (ready) ready(bucket.flat);
    return comm::allreduce_async(comm, bucket.flat.data_ptr(), size_t(bucket.flat.numel()),
                                 bucket.flat.dtype(), allreduce);
  };
}

void allreduce_through_host(comm::Communicator& comm, const Tensor& t,
                            const comm::AllreduceOptions& options) {
  CHECK(t.defined() && t.is_contiguous()) << "allreduce_through_host takes a contiguous tensor";
  // A CPU tensor takes the same round trip (a clone), so tests on the CPU
  // run the data flow of a GPU's.
  Tensor host = t.device().is_cpu() ? t.clone() : t.to(Device{});
  comm::allreduce(comm, host.data_ptr(), size_t(host.numel()), host.dtype(), options);
  Tensor dst = t;
  dst.copy_(host);
}

BucketReduceFn staged_reduce(std::shared_ptr<BucketCopier> copier, DeviceStagingOptions options) {
  CHECK(copier) << "staged_reduce without a copier";
  auto stager = std::make_shared<Stager>(std::move(copier), options);
  return [stager](comm::Communicator& comm, const Bucket& bucket) {
    return stager->reduce(comm, bucket);
  };
}

}  // namespace trainer::parallel
