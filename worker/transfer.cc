#include "worker/transfer.h"

#include <cstring>
#include <string>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/dtype.h"
#include "core/status.h"

namespace tessel::worker {

namespace {

std::string RegionString(const v1::Region& r) {
  std::vector<std::string> dims;
  for (int i = 0; i < r.starts_size() && i < r.sizes_size(); ++i) {
    dims.push_back(absl::StrCat(r.starts(i), ":", r.starts(i) + r.sizes(i)));
  }
  return absl::StrCat("[", absl::StrJoin(dims, ", "), "]");
}

// Copies `region` of `block` (at `base`) to or from the packed `staging`.
void Pack(const v1::TensorType& block, const v1::Region& region, const char* base, char* staging) {
  ForEachRun(block, region, [&](int64_t off, int64_t len) {
    std::memcpy(staging, base + off, len);
    staging += len;
  });
}
void Unpack(const v1::TensorType& block, const v1::Region& region, const char* staging,
            char* base) {
  ForEachRun(block, region, [&](int64_t off, int64_t len) {
    std::memcpy(base + off, staging, len);
    staging += len;
  });
}

// The region's byte offset when it is one contiguous run of its block; -1 otherwise.
int64_t ContiguousOffset(const v1::TensorType& block, const v1::Region& region) {
  int runs = 0;
  int64_t first = -1;
  ForEachRun(block, region, [&](int64_t off, int64_t) {
    if (runs++ == 0) first = off;
  });
  return runs == 1 ? first : -1;
}

std::string What(const v1::RunRequest& r, const Device& device) {
  return absl::StrCat("execution ", r.execution_id(), " (reshard) on ", device.name());
}

}  // namespace

GroupSpec TransferGroup(const v1::RunRequest& r) {
  const v1::Transfer& t = r.transfer();
  GroupSpec spec;
  spec.rank_workers.assign(t.rank_workers().begin(), t.rank_workers().end());
  spec.rank_devices.assign(t.rank_devices().begin(), t.rank_devices().end());
  if (!t.one_way()) {
    // As ResolveGroup names groups: a program over the same devices shares it.
    spec.key =
        absl::StrCat("devices:", absl::StrJoin(spec.rank_devices, ","), "@", r.collective_epoch());
    return spec;
  }
  std::vector<int> senders;
  for (const v1::TransferPiece& p : t.pieces()) {
    if (p.round() >= 0 && absl::c_find(senders, p.source()) == senders.end())
      senders.push_back(p.source());
  }
  absl::c_sort(senders);
  spec.key = absl::StrCat("devices:", absl::StrJoin(spec.rank_devices, ","),
                          ";from:", absl::StrJoin(senders, ","), "@", r.collective_epoch());
  return spec;
}

TransferBytes BytesOf(const v1::Transfer& t) {
  TransferBytes b;
  const int64_t esize = DTypeSize(t.source_block().dtype());
  for (const v1::TransferPiece& p : t.pieces()) {
    int64_t n = esize;
    for (int64_t s : p.from().sizes()) n *= s;
    if (p.round() < 0) {
      b.copied += n;
    } else if (p.source() == t.rank() && p.target() != t.rank()) {
      b.sent += n;
    } else if (p.target() == t.rank() && p.source() != t.rank()) {
      b.received += n;
    } else if (p.source() == t.rank()) {
      b.copied += n;
    }
  }
  return b;
}

bool IsDetachedSend(const v1::RunRequest& r) {
  const v1::Transfer& t = r.transfer();
  return r.has_transfer() && t.one_way() && t.rank() >= 0 && t.rounds() > 0 &&
         r.arguments_size() == 1 && r.outputs_size() == 0;
}

void ForEachRun(const v1::TensorType& block, const v1::Region& region,
                const std::function<void(int64_t, int64_t)>& f) {
  const int n = block.dims_size();
  const int64_t esize = DTypeSize(block.dtype());
  for (int i = 0; i < n; ++i) {
    if (region.sizes(i) == 0) return;
  }
  if (n == 0) return f(0, esize);
  std::vector<int64_t> stride(n);
  int64_t s = esize;
  for (int i = n - 1; i >= 0; --i) {
    stride[i] = s;
    s *= block.dims(i);
  }
  // Dimensions k.. form one run: every one after k is whole.
  int k = n - 1;
  while (k > 0 && region.starts(k) == 0 && region.sizes(k) == block.dims(k)) --k;
  const int64_t run = region.sizes(k) * stride[k];
  std::vector<int64_t> idx(k, 0);
  while (true) {
    int64_t off = region.starts(k) * stride[k];
    for (int i = 0; i < k; ++i) off += (region.starts(i) + idx[i]) * stride[i];
    f(off, run);
    int i = k - 1;
    while (i >= 0 && ++idx[i] == region.sizes(i)) idx[i--] = 0;
    if (i < 0) return;
  }
}

int64_t RegionBytes(const v1::TensorType& block, const v1::Region& region) {
  int64_t b = DTypeSize(block.dtype());
  for (int64_t z : region.sizes()) b *= z;
  return b;
}

absl::Status CheckRegion(const v1::TensorType& block, const v1::Region& region,
                         const std::string& what) {
  if (region.starts_size() != block.dims_size() || region.sizes_size() != block.dims_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": region ", RegionString(region), " has rank ", region.starts_size(),
                     "; its block ", TypeString(block), " has rank ", block.dims_size()));
  }
  for (int i = 0; i < block.dims_size(); ++i) {
    if (region.starts(i) < 0 || region.sizes(i) < 0 ||
        region.starts(i) + region.sizes(i) > block.dims(i)) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": region ", RegionString(region),
                                                     " is outside its block ", TypeString(block)));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckTransfer(const v1::RunRequest& r, const Device& device, const BufferPtr& source) {
  const v1::Transfer& t = r.transfer();
  const std::string what = What(r, device);
  if (device.kind() != "cpu") {
    return absl::UnimplementedError(
        absl::StrCat(what,
                     ": resharding moves blocks of host-memory devices only; this "
                     "device is '",
                     device.kind(), "'"));
  }
  if (r.arguments_size() > 1 || r.outputs_size() > 1 ||
      (r.arguments_size() == 1) != (source != nullptr)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": takes at most one source and one target block"));
  }
  const bool has_source = source != nullptr, has_target = r.outputs_size() == 1;
  if (has_source && source->size() != ByteSizeUnchecked(t.source_block())) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": the source block holds ",
                                                   source->size(), " bytes; the plan says ",
                                                   TypeString(t.source_block())));
  }
  const int size = t.rank_workers_size();
  if (t.rank_devices_size() != size || t.rank() < -1 || t.rank() >= size) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": rank ", t.rank(), " of a group of ", size));
  }
  // Check the whole plan before anything moves.
  for (const v1::TransferPiece& p : t.pieces()) {
    const bool mine_send = p.round() < 0 || p.source() == t.rank();
    const bool mine_recv = p.round() < 0 || p.target() == t.rank();
    if (p.round() >= t.rounds() || (p.round() >= 0 && (p.source() < 0 || p.source() >= size ||
                                                       p.target() < 0 || p.target() >= size))) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": a piece of round ", p.round(),
                                                     " between ranks ", p.source(), " and ",
                                                     p.target(), " is outside the plan"));
    }
    if (p.round() >= 0 && t.rank() < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": the plan has rounds, and this device no rank"));
    }
    if (mine_send) {
      if (!has_source)
        return absl::InvalidArgumentError(
            absl::StrCat(what, ": sends a piece, and holds no source"));
      TESSEL_RETURN_IF_ERROR(CheckRegion(t.source_block(), p.from(), what));
    }
    if (mine_recv) {
      if (!has_target)
        return absl::InvalidArgumentError(
            absl::StrCat(what, ": receives a piece, and makes no target"));
      TESSEL_RETURN_IF_ERROR(CheckRegion(t.target_block(), p.to(), what));
    }
    if (RegionBytes(t.source_block(), p.from()) != RegionBytes(t.target_block(), p.to())) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": a piece's regions differ in size: ", RegionString(p.from()),
                       " and ", RegionString(p.to())));
    }
  }
  if (t.one_way() && has_source && has_target) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": the transfer is one-way, and this device both holds a ",
                     "source block and makes a target block"));
  }
  return absl::OkStatus();
}

absl::StatusOr<BufferPtr> RunTransfer(const v1::RunRequest& r, Device& device,
                                      const BufferPtr& source, CommunicatorRegistry* collectives,
                                      int* last_round) {
  TESSEL_RETURN_IF_ERROR(CheckTransfer(r, device, source));
  const v1::Transfer& t = r.transfer();
  const std::string what = What(r, device);
  const bool has_source = source != nullptr, has_target = r.outputs_size() == 1;
  BufferPtr target;
  if (has_target) {
    TESSEL_ASSIGN_OR_RETURN(target, device.Allocate(ByteSizeUnchecked(t.target_block())));
  }
  const char* src = has_source ? static_cast<const char*>(source->opaque()) : nullptr;
  char* dst = has_target ? static_cast<char*>(target->opaque()) : nullptr;
  std::vector<char> staging;
  // Local copies first: they need no peer.
  for (const v1::TransferPiece& p : t.pieces()) {
    if (p.round() >= 0) continue;
    const int64_t in = ContiguousOffset(t.source_block(), p.from()),
                  out = ContiguousOffset(t.target_block(), p.to());
    if (in >= 0 && out >= 0) {
      std::memcpy(dst + out, src + in, RegionBytes(t.source_block(), p.from()));
    } else {
      staging.resize(RegionBytes(t.source_block(), p.from()));
      Pack(t.source_block(), p.from(), src, staging.data());
      Unpack(t.target_block(), p.to(), staging.data(), dst);
    }
  }
  if (t.rounds() == 0) return target;
  if (collectives == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": this worker has no collectives configured"));
  }
  TESSEL_ASSIGN_OR_RETURN(std::shared_ptr<Communicator> comm, collectives->Get(TransferGroup(r)));
  std::vector<char> send_staging, recv_staging;
  for (int round = 0; round < t.rounds(); ++round) {
    std::vector<std::pair<int, int>> pairs;
    const v1::TransferPiece *send = nullptr, *recv = nullptr;
    int64_t bytes = -1;
    for (const v1::TransferPiece& p : t.pieces()) {
      if (p.round() != round) continue;
      pairs.emplace_back(p.source(), p.target());
      const int64_t b = RegionBytes(t.source_block(), p.from());
      if (bytes >= 0 && b != bytes) {
        return absl::InvalidArgumentError(
            absl::StrCat(what, ": round ", round, " has pieces of ", bytes, " and ", b, " bytes"));
      }
      bytes = b;
      if (p.source() == t.rank()) send = &p;
      if (p.target() == t.rank()) recv = &p;
    }
    if (bytes < 0) continue;
    const void* in = nullptr;
    void* out = nullptr;
    if (send != nullptr) {
      const int64_t off = ContiguousOffset(t.source_block(), send->from());
      if (off >= 0) {
        in = src + off;
      } else {
        send_staging.resize(bytes);
        Pack(t.source_block(), send->from(), src, send_staging.data());
        in = send_staging.data();
      }
    }
    int64_t recv_off = -1;
    if (recv != nullptr) {
      recv_off = ContiguousOffset(t.target_block(), recv->to());
      if (recv_off >= 0) {
        out = dst + recv_off;
      } else {
        recv_staging.resize(bytes);
        out = recv_staging.data();
      }
    }
    *last_round = round;
    TESSEL_RETURN_IF_ERROR(comm->Permute(t.rank(), CollectiveId{r.execution_id(), round, 0}, in,
                                         out, bytes, v1::U8, pairs));
    if (recv != nullptr && recv_off < 0)
      Unpack(t.target_block(), recv->to(), recv_staging.data(), dst);
  }
  return target;
}

void AbandonTransfer(const v1::RunRequest& r, CommunicatorRegistry* collectives, int last_round,
                     const absl::Status& cause) {
  const v1::Transfer& t = r.transfer();
  if (collectives == nullptr || t.rank() < 0 || last_round + 1 >= t.rounds()) return;
  auto comm = collectives->Get(TransferGroup(r));
  if (!comm.ok()) return;
  for (int round = last_round + 1; round < t.rounds(); ++round) {
    (void)(*comm)->Abandon(t.rank(), CollectiveId{r.execution_id(), round, 0}, cause);
  }
}

}  // namespace tessel::worker
