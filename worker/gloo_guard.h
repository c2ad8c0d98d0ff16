// A guard for Gloo's TCP connect, which can otherwise end the process.
//
// Gloo 0.5 (Debian's 2022 snapshot) sets up a new connection on its
// event-loop thread, and takes the peer's address there with a check that
// throws when the peer has already reset the connection: a listener closed
// with the connection still in its queue, or a peer that gave up on the group
// (or died) just after connecting. An exception on that thread terminates the
// worker, so one peer's failure could take down the others.
//
// gloo_guard.cc gives Gloo a peer-address lookup that cannot throw, as
// upstream Gloo does since 2025 (Socket::safePeerName). The connection is
// then set up without a peer address, its first read sees the reset, and the
// pair fails with Gloo's IoException: the collective and its group fail,
// naming the cause, and the worker keeps serving.
//
// Mechanism: libgloo calls Address::fromPeerName through its PLT, so the
// definition in this executable takes precedence over libgloo's (ELF symbol
// interposition; the same rule that lets a program supply its own malloc).
#pragma once

#include <cstdint>
#include <memory>

#include "spdlog/logger.h"

namespace tessel::worker {

// Whether Gloo's calls reach the guard's lookup: false when the executable
// does not export it (it then uses libgloo's, which throws).
bool GlooPeerNameGuardActive();

// Where the guard reports a connection found reset while being set up (null:
// nowhere). Process-wide; the last registry opened sets it.
void SetGlooGuardLogger(std::shared_ptr<spdlog::logger> log);

// Connections found reset while being set up, in this process.
int64_t GlooConnectionsResetDuringSetup();

}  // namespace tessel::worker
