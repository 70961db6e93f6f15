#include "comm/communicator.h"

#include <algorithm>
#include <deque>
#include <thread>

#include "comm/algorithms.h"
#include "comm/log.h"
#include "comm/watchdog.h"
#include "core/cpu/threads.h"

namespace trainer::comm {

// What the communicators of one process share: the store, the transport and
// the next free communicator id.
struct World {
  std::unique_ptr<Store> store;
  std::unique_ptr<Transport> transport;
  std::mutex mutex;
  uint32_t next_comm_id = 1;  // 0 is the world
};

// ---- Work and the progress thread ----

bool Work::test() const {
  if (operation_) return operation_->test();
  if (!state_) return true;
  std::lock_guard<std::mutex> lock(state_->mutex);
  if (state_->error) std::rethrow_exception(state_->error);
  return state_->done;
}

void Work::wait() const {
  if (operation_) return operation_->wait();
  if (!state_) return;
  std::unique_lock<std::mutex> lock(state_->mutex);
  state_->done_cv.wait(lock, [&] { return state_->done; });
  if (state_->error) std::rethrow_exception(state_->error);
}

// Runs queued operations one after another; stops after draining the queue.
class ProgressThread {
 public:
  ProgressThread() : thread_([this] { run(); }) {}
  ~ProgressThread() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_one();
    thread_.join();
  }

  Work push(std::function<void()> fn) {
    auto state = std::make_shared<Work::State>();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.emplace_back(std::move(fn), state);
    }
    wake_.notify_one();
    return Work(state);
  }

 private:
  void run() {
    use_one_kernel_thread();  // queued work may widen a bf16 bucket
    for (;;) {
      std::pair<std::function<void()>, std::shared_ptr<Work::State>> item;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;
        item = std::move(queue_.front());
        queue_.pop_front();
      }
      std::exception_ptr error;
      try {
        item.first();
      } catch (...) {
        error = std::current_exception();
      }
      item.first = nullptr;  // release what the task kept alive before waking the waiter
      std::lock_guard<std::mutex> lock(item.second->mutex);
      item.second->error = error;
      item.second->done = true;
      item.second->done_cv.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::pair<std::function<void()>, std::shared_ptr<Work::State>>> queue_;
  bool stopping_ = false;
  std::thread thread_;
};

// ---- Communicator ----

Communicator::Communicator(std::shared_ptr<World> world, uint32_t id, std::vector<int> members,
                           int rank, const CommOptions& options)
    : world_(std::move(world)),
      id_(id),
      members_(std::move(members)),
      rank_(rank),
      options_(options) {}

Communicator::~Communicator() = default;

Transport& Communicator::transport() const { return *world_->transport; }

Work Communicator::enqueue(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(world_->mutex);
    if (!progress_) progress_ = std::make_unique<ProgressThread>();
  }
  return progress_->push(std::move(fn));
}

ShmChannel* Communicator::shm() {
  std::lock_guard<std::mutex> lock(shm_mutex_);
  if (!shm_created_) {
    shm_created_ = true;
    if (options_.shared_memory && world_->store)
      shm_ = ShmChannel::create(*world_->store, transport(), members_, rank_, id_);
  }
  return shm_.get();
}

std::shared_ptr<ShmRegion> Communicator::share_memory(size_t bytes) {
  ShmChannel* channel = shm();
  if (!channel) return nullptr;
  const uint64_t id = ++regions_created_;  // alike on every rank: creation is collective
  std::vector<long> pids;
  for (int r = 0; r < size(); ++r) pids.push_back(channel->pid(r));
  // Disjoint communicators may share an id: the members make the key unique.
  std::string key = cat("shm-region/", id_, "/", id, "/");
  for (int world : members_) key += cat(world, ",");
  std::string why;
  std::shared_ptr<ShmRegion> region =
      ShmRegion::create(*world_->store, pids, rank_, key + "/", id, bytes, &why);
  if (!region) {
    COMM_LOG(LogLevel::info, "communicator ", id_, ": no shared region of ", bytes, " bytes (", why,
             "); collectives copy through the staging areas");
    return nullptr;
  }
  channel->add_region(region);
  return region;
}

std::shared_ptr<Communicator> Communicator::split(int color, int key) {
  // Every rank publishes (color, key, its next free id); the new ids start at
  // the largest of those, so no member already uses them for another communicator.
  struct Entry {
    int32_t color, key, next_id;
  };
  uint32_t my_next;
  {
    std::lock_guard<std::mutex> lock(world_->mutex);
    my_next = world_->next_comm_id;
  }
  std::vector<Entry> all(static_cast<size_t>(size()));
  Entry mine{color, key, int32_t(my_next)};
  {
    OpChannel ch(*this, next_seq(), "split", options_.timeout);
    all[size_t(rank_)] = mine;
    all_gather_ring(ch, all.data(), sizeof(Entry), sizeof(Entry) * all.size());
  }
  uint32_t base = 0;
  std::vector<int> colors;
  for (const Entry& e : all) {
    base = std::max(base, uint32_t(e.next_id));
    if (e.color >= 0) colors.push_back(e.color);
  }
  std::sort(colors.begin(), colors.end());
  colors.erase(std::unique(colors.begin(), colors.end()), colors.end());
  if (base + colors.size() > kMaxCommunicators)
    throw Error(cat("rank ", world_rank(rank_), ": more than ", kMaxCommunicators,
                    " communicators; the tag space holds no more"));
  {
    std::lock_guard<std::mutex> lock(world_->mutex);
    world_->next_comm_id = base + uint32_t(colors.size());
  }
  if (color < 0) return nullptr;

  std::vector<int> order;  // ranks of this communicator with our color, by (key, rank)
  for (int r = 0; r < size(); ++r)
    if (all[size_t(r)].color == color) order.push_back(r);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return all[size_t(a)].key < all[size_t(b)].key; });
  std::vector<int> members;
  int new_rank = -1;
  for (int r : order) {
    if (r == rank_) new_rank = int(members.size());
    members.push_back(world_rank(r));
  }
  uint32_t id =
      base + uint32_t(std::lower_bound(colors.begin(), colors.end(), color) - colors.begin());
  COMM_LOG(LogLevel::debug, "split of communicator ", id_, " (color ", color, ", key ", key,
           "): communicator ", id, ", rank ", new_rank, " of ", members.size());
  return std::shared_ptr<Communicator>(
      new Communicator(world_, id, std::move(members), new_rank, options_));
}

std::shared_ptr<Communicator> init_world(const Bootstrap& boot, const CommOptions& given) {
  CommOptions options = given;
  if (boot.comm_timeout_ms > 0) options.timeout = Millis(boot.comm_timeout_ms);
  set_log_rank(boot.rank);
  set_log_level(boot.log_level);
  watchdog::start(boot);
  auto world = std::make_shared<World>();
  if (boot.world_size > 1) {
    StoreOptions so;
    so.host = boot.master_addr;
    so.port = boot.master_port;
    so.token = boot.job_token;
    so.rank = boot.rank;
    so.serve = boot.rank == 0;
    so.connect_timeout = options.connect_timeout;
    so.timeout = options.connect_timeout;
    world->store = std::make_unique<Store>(so);
  }
  world->transport = std::make_unique<Transport>(world->store.get(), boot.rank, boot.world_size,
                                                 options.detect_peer_failure);
  std::vector<int> members(size_t(boot.world_size));
  for (int r = 0; r < boot.world_size; ++r) members[size_t(r)] = r;
  COMM_LOG(LogLevel::debug, "world of ", boot.world_size, " ranks connected");
  return std::shared_ptr<Communicator>(
      new Communicator(world, 0, std::move(members), boot.rank, options));
}

}  // namespace trainer::comm
