// NcclCommunicator on one GPU: a group of one rank, checked on exact data (nccl-tests style: every
// element is a function of (source rank, destination rank, index), so every received element and
// every element of padding that must stay untouched is compared exactly). One process, not under
// mpirun: MPI starts as a singleton world of one rank, which bootstraps NCCL. Where there is no GPU
// the GPU tests skip, printing why; the checks of create()'s errors and of the lane priorities run
// everywhere. Several GPUs and ranks need mpirun (one rank per GPU); these tests cover what one
// rank can check: the mapping of every operation to NCCL, the self blocks, staging of host memory,
// split, and the event hook.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "comm/mpi_communicator.h"
#include "comm/nccl/nccl_communicator.h"
#include "cuda/device.h"
#include "tests/mpi_test_env.h"

namespace moe::comm {
namespace {

const ::testing::Environment* const g_env = ::testing::AddGlobalTestEnvironment(new MpiTestEnvironment());

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// ---- without a GPU ----

TEST(NcclCreate, FailsNamingTheMissingDevice) {
  const int missing = cuda::device_count();  // one past the last device: never valid
  std::unique_ptr<NcclCommunicator> comm;
  Status st = NcclCommunicator::create(*g_world, missing, 0, "nccl-test", &comm);
  ASSERT_FALSE(st);
  EXPECT_EQ(comm, nullptr);
  std::printf("create(device %d): %s\n", missing, st.message().c_str());
  EXPECT_TRUE(contains(st.message(), "rank 0: creating NCCL group 'nccl-test': no CUDA device " +
                                         std::to_string(missing)))
      << st.message();
  // The ranks agreed on the failure over the bootstrap, which is still in step and usable.
  Status b = g_world->barrier();
  EXPECT_TRUE(b) << b.message();

  StreamPriorityRange range;
  st = NcclCommunicator::stream_priority_range(missing, &range);
  ASSERT_FALSE(st);
  EXPECT_TRUE(contains(st.message(), "no CUDA device " + std::to_string(missing))) << st.message();
}

TEST(NcclLanes, AllToAllAndGatherOutrankAllreduce) {
  const StreamPriorityRange range{/*least=*/0, /*greatest=*/-5};
  EXPECT_EQ(NcclCommunicator::lane_priority(CommLane::a2a, range), -5);
  EXPECT_EQ(NcclCommunicator::lane_priority(CommLane::gather, range), -5);
  EXPECT_EQ(NcclCommunicator::lane_priority(CommLane::allreduce, range), 0);
}

// ---- on one GPU ----

// Element i that rank `src` sends to rank `dst`: distinct per (src, dst, i) and exact in float.
template <typename T>
T value(int src, int dst, int64_t i) {
  return static_cast<T>(1 + src * 65536 + dst * 4096 + i);
}
template <typename T>
constexpr T kUntouched = static_cast<T>(-7);

template <typename T>
std::vector<T> pattern(int64_t n, int src = 0, int dst = 0) {
  std::vector<T> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = value<T>(src, dst, i);
  return v;
}

template <typename T>
cuda::DeviceBuffer to_device(const std::vector<T>& h) {
  cuda::DeviceBuffer b;
  Status st = b.allocate(h.size() * sizeof(T));
  if (!st) throw std::runtime_error(st.message());
  if (cudaMemcpy(b.get(), h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice) != cudaSuccess)
    throw std::runtime_error("cudaMemcpy to device failed");
  return b;
}

template <typename T>
std::vector<T> to_host(const cuda::DeviceBuffer& b, size_t n) {
  std::vector<T> h(n);
  if (cudaMemcpy(h.data(), b.get(), n * sizeof(T), cudaMemcpyDeviceToHost) != cudaSuccess)
    throw std::runtime_error("cudaMemcpy to host failed");
  return h;
}

// Counts the elements of `got` that differ from `want` (printing the first few).
template <typename T>
int wrong(const std::vector<T>& got, const std::vector<T>& want) {
  int bad = 0;
  for (size_t i = 0; i < want.size(); ++i)
    if (got[i] != want[i] && bad++ < 5)
      ADD_FAILURE() << "element " << i << ": got " << got[i] << ", want " << want[i];
  return bad;
}

class NcclOneGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda::device_count() == 0) GTEST_SKIP() << cuda::device_summary();  // says "no CUDA device ..." and why
    StreamPriorityRange range;
    Status st = NcclCommunicator::stream_priority_range(0, &range);
    ASSERT_TRUE(st) << st.message();
    ASSERT_LE(range.greatest, range.least);
    st = NcclCommunicator::create(*g_world, 0, NcclCommunicator::lane_priority(CommLane::a2a, range), "nccl1",
                                  &comm_);
    ASSERT_TRUE(st) << st.message();
    ASSERT_EQ(comm_->size(), 1);
    ASSERT_EQ(comm_->rank(), 0);
    int priority = 0;
    ASSERT_EQ(cudaStreamGetPriority(comm_->stream(), &priority), cudaSuccess);
    EXPECT_EQ(priority, range.greatest);
  }
  std::unique_ptr<NcclCommunicator> comm_;
};

template <typename T>
class NcclOneGpuTyped : public NcclOneGpu {};
using Elements = ::testing::Types<float, double, int64_t>;
TYPED_TEST_SUITE(NcclOneGpuTyped, Elements);

TYPED_TEST(NcclOneGpuTyped, AlltoallvMovesTheOwnBlockAndLeavesTheRest) {
  using T = TypeParam;
  NcclCommunicator& c = *this->comm_;
  const std::vector<T> send = pattern<T>(16);
  std::vector<T> want(20, kUntouched<T>);
  for (int j = 0; j < 5; ++j) want[6 + j] = send[3 + j];
  cuda::DeviceBuffer dsend = to_device(send);
  cuda::DeviceBuffer drecv = to_device(std::vector<T>(20, kUntouched<T>));
  const std::vector<int64_t> sc{5}, sd{3}, rc{5}, rd{6};
  Status st = c.alltoallv(dsend.as<T>(), sc, sd, drecv.as<T>(), rc, rd);
  ASSERT_TRUE(st) << st.message();
  EXPECT_EQ(wrong(to_host<T>(drecv, 20), want), 0);

  cuda::DeviceBuffer dall = to_device(std::vector<T>(4, kUntouched<T>));
  st = c.alltoall(dsend.as<T>(), dall.as<T>(), 4);
  ASSERT_TRUE(st) << st.message();
  EXPECT_EQ(wrong(to_host<T>(dall, 4), std::vector<T>(send.begin(), send.begin() + 4)), 0);
}

TYPED_TEST(NcclOneGpuTyped, AllreduceSumMaxMinOnDeviceAndHostMemory) {
  using T = TypeParam;
  NcclCommunicator& c = *this->comm_;
  const int64_t n = 1 << 16;  // large enough for NCCL's chunked kernels
  const std::vector<T> data = pattern<T>(n);
  for (ReduceOp op : {ReduceOp::sum, ReduceOp::max, ReduceOp::min}) {
    SCOPED_TRACE(reduce_op_name(op));
    cuda::DeviceBuffer d = to_device(data);
    Status st = c.allreduce(d.as<T>(), n, op);
    ASSERT_TRUE(st) << st.message();
    EXPECT_EQ(wrong(to_host<T>(d, n), data), 0);  // one rank: the reduction of one contribution
  }
  // Host memory is staged (Communicator::split relies on it).
  std::vector<T> host = pattern<T>(3);
  Status st = c.allreduce(host.data(), 3, ReduceOp::max);
  ASSERT_TRUE(st) << st.message();
  EXPECT_EQ(wrong(host, pattern<T>(3)), 0);
}

TYPED_TEST(NcclOneGpuTyped, AllgatherAndAllgatherv) {
  using T = TypeParam;
  NcclCommunicator& c = *this->comm_;
  const std::vector<T> send = pattern<T>(8);
  cuda::DeviceBuffer dsend = to_device(send);
  cuda::DeviceBuffer drecv = to_device(std::vector<T>(8, kUntouched<T>));
  Status st = c.allgather(dsend.as<T>(), 8, drecv.as<T>());
  ASSERT_TRUE(st) << st.message();
  EXPECT_EQ(wrong(to_host<T>(drecv, 8), send), 0);

  // In place: this rank's block already sits in recv.
  cuda::DeviceBuffer dinplace = to_device(send);
  st = c.allgather(dinplace.as<T>() + c.rank() * 8, 8, dinplace.as<T>());
  ASSERT_TRUE(st) << st.message();
  EXPECT_EQ(wrong(to_host<T>(dinplace, 8), send), 0);

  cuda::DeviceBuffer dv = to_device(std::vector<T>(8, kUntouched<T>));
  const std::vector<int64_t> rc{3}, rd{2};
  st = c.allgatherv(dsend.as<T>(), 3, dv.as<T>(), rc, rd);
  ASSERT_TRUE(st) << st.message();
  std::vector<T> want(8, kUntouched<T>);
  for (int j = 0; j < 3; ++j) want[2 + j] = send[j];
  EXPECT_EQ(wrong(to_host<T>(dv, 8), want), 0);
}

TYPED_TEST(NcclOneGpuTyped, ReduceScatterBroadcastReduce) {
  using T = TypeParam;
  NcclCommunicator& c = *this->comm_;
  const std::vector<T> send = pattern<T>(6);
  cuda::DeviceBuffer dsend = to_device(send);
  cuda::DeviceBuffer drecv = to_device(std::vector<T>(6, kUntouched<T>));
  Status st = c.reduce_scatter(dsend.as<T>(), drecv.as<T>(), 6, ReduceOp::sum);
  ASSERT_TRUE(st) << st.message();
  EXPECT_EQ(wrong(to_host<T>(drecv, 6), send), 0);

  cuda::DeviceBuffer dbcast = to_device(send);
  st = c.broadcast(dbcast.as<T>(), 6, 0);
  ASSERT_TRUE(st) << st.message();
  EXPECT_EQ(wrong(to_host<T>(dbcast, 6), send), 0);

  cuda::DeviceBuffer dred = to_device(std::vector<T>(6, kUntouched<T>));
  st = c.reduce(dsend.as<T>(), dred.as<T>(), 6, 0, ReduceOp::max);
  ASSERT_TRUE(st) << st.message();
  EXPECT_EQ(wrong(to_host<T>(dred, 6), send), 0);
  cuda::DeviceBuffer dinplace = to_device(send);
  st = c.reduce(dinplace.as<T>(), dinplace.as<T>(), 6, 0, ReduceOp::sum);
  ASSERT_TRUE(st) << st.message();
  EXPECT_EQ(wrong(to_host<T>(dinplace, 6), send), 0);
}

TYPED_TEST(NcclOneGpuTyped, SendrecvToItself) {
  using T = TypeParam;
  NcclCommunicator& c = *this->comm_;
  const std::vector<T> send = pattern<T>(7, 0, 0);
  cuda::DeviceBuffer dsend = to_device(send);
  cuda::DeviceBuffer drecv = to_device(std::vector<T>(9, kUntouched<T>));
  Status st = c.sendrecv(dsend.as<T>(), 7, 0, drecv.as<T>() + 1, 7, 0);
  ASSERT_TRUE(st) << st.message();
  std::vector<T> want(9, kUntouched<T>);
  for (int j = 0; j < 7; ++j) want[1 + j] = send[j];
  EXPECT_EQ(wrong(to_host<T>(drecv, 9), want), 0);
}

TEST_F(NcclOneGpu, BarrierAndEmptyOperations) {
  Status st = comm_->barrier();
  ASSERT_TRUE(st) << st.message();
  st = comm_->allreduce(static_cast<float*>(nullptr), 0);
  ASSERT_TRUE(st) << st.message();
  const std::vector<int64_t> zero{0};
  st = comm_->alltoallv(static_cast<const float*>(nullptr), zero, zero, static_cast<float*>(nullptr), zero, zero);
  ASSERT_TRUE(st) << st.message();
  st = comm_->barrier();
  ASSERT_TRUE(st) << st.message();
}

TEST_F(NcclOneGpu, SplitAndDupMakeWorkingNcclGroups) {
  std::unique_ptr<Communicator> solo;
  const int members[] = {0};
  Status st = comm_->split(members, "solo", &solo);
  ASSERT_TRUE(st) << st.message();
  auto* nccl = dynamic_cast<NcclCommunicator*>(solo.get());
  ASSERT_NE(nccl, nullptr);
  EXPECT_EQ(solo->name(), "solo");
  EXPECT_EQ(solo->size(), 1);
  EXPECT_EQ(solo->world_ranks(), std::vector<int>{g_world->world_rank()});
  EXPECT_EQ(nccl->device(), comm_->device());
  EXPECT_EQ(nccl->stream_priority(), comm_->stream_priority());
  EXPECT_NE(nccl->stream(), comm_->stream());
  EXPECT_EQ(solo->timeout(), comm_->timeout());

  const std::vector<int64_t> data = pattern<int64_t>(100);
  cuda::DeviceBuffer d = to_device(data);
  st = solo->allreduce(d.as<int64_t>(), 100, ReduceOp::sum);
  ASSERT_TRUE(st) << st.message();
  EXPECT_EQ(wrong(to_host<int64_t>(d, 100), data), 0);

  std::unique_ptr<Communicator> twin;
  st = comm_->dup("twin", &twin);
  ASSERT_TRUE(st) << st.message();
  EXPECT_EQ(twin->name(), "twin");
  st = twin->barrier();
  ASSERT_TRUE(st) << st.message();
  // The parent still works after its children exist.
  st = comm_->barrier();
  ASSERT_TRUE(st) << st.message();
}

TEST_F(NcclOneGpu, EnqueuedOperationsOrderWithOtherStreamsThroughEvents) {
  NcclCommunicator& c = *comm_;
  const int64_t n = 4096;
  cudaStream_t user = nullptr;
  cudaEvent_t written = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&user, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaEventCreateWithFlags(&written, cudaEventDisableTiming), cudaSuccess);

  // The "compute" stream writes the send buffer; the communicator waits for it through an event.
  const std::vector<float> send = pattern<float>(n);
  cuda::DeviceBuffer dsend, drecv, dsum;
  ASSERT_TRUE(dsend.allocate(n * sizeof(float)));
  drecv = to_device(std::vector<float>(n, kUntouched<float>));
  dsum = to_device(pattern<float>(n));
  ASSERT_EQ(cudaMemcpyAsync(dsend.get(), send.data(), n * sizeof(float), cudaMemcpyHostToDevice, user), cudaSuccess);
  ASSERT_EQ(cudaEventRecord(written, user), cudaSuccess);
  Status st = c.depend_on(written);
  ASSERT_TRUE(st) << st.message();

  const std::vector<int64_t> counts{n}, displs{0};
  st = c.enqueue_alltoallv(dsend.as<float>(), counts, displs, drecv.as<float>(), counts, displs);
  ASSERT_TRUE(st) << st.message();
  st = c.enqueue_allreduce(dsum.as<float>(), n, ReduceOp::max);
  ASSERT_TRUE(st) << st.message();

  // The compute stream reads the results after waiting on the communicator's event.
  ASSERT_EQ(cudaStreamWaitEvent(user, c.last_event(), 0), cudaSuccess);
  std::vector<float> got(n), got_sum(n);
  ASSERT_EQ(cudaMemcpyAsync(got.data(), drecv.get(), n * sizeof(float), cudaMemcpyDeviceToHost, user), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(got_sum.data(), dsum.get(), n * sizeof(float), cudaMemcpyDeviceToHost, user),
            cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(user), cudaSuccess);
  EXPECT_EQ(wrong(got, send), 0);
  EXPECT_EQ(wrong(got_sum, pattern<float>(n)), 0);

  st = c.wait();
  ASSERT_TRUE(st) << st.message();
  // Violated REQUIRES throw without communicating, as in the blocking calls.
  const std::vector<int64_t> two{1, 1};
  EXPECT_THROW((void)c.enqueue_alltoallv(dsend.as<float>(), two, two, drecv.as<float>(), two, two), std::logic_error);
  EXPECT_THROW((void)c.enqueue_allreduce(dsum.as<float>(), -1), std::logic_error);

  cudaEventDestroy(written);
  cudaStreamDestroy(user);
}

}  // namespace
}  // namespace moe::comm
