// Package ioctl is the binary interface between programs and the mounted
// store, and a small Go client for it.
//
// Commands are restricted FUSE ioctls: the kernel copies exactly
// _IOC_SIZE(cmd) bytes in and/or out and follows no pointers, so every
// argument is a fixed-size, 8-byte-aligned, explicitly padded little-endian
// struct whose first word is its own size and a flags word, for extension.
// All commands share one type byte, Type ('M'). Sizes, offsets and numbers
// are pinned by abi_test.go; a change there is an ABI break.
//
// Probes:
//
//	GET_MAGIC        -> MagicArg{Magic: MagicValue}: "this file is on mooncake-fs"
//	GET_ABI_VERSION  -> ABIVersionArg{Major, Minor}
//
// An unknown command on a mooncake-fs file fails with ENOTTY. The package
// imports nothing of the daemon, so client programs can use it alone.
// ReadStatus reads the daemon's status (JSON) from the mount root's
// attribute StatusXattr.
//
// # Client
//
// A File (Open, OpenDir) is an open file or directory on a mount; its
// methods act on the file's key, or, for batches on a directory, on keys
// relative to it. Every data command makes exactly one copy per byte,
// except the KEY_INLINE calls (ABI 1.9), whose value of up to InlineBytes
// rides in the call itself:
//
//	f, _ := ioctl.Open("/mnt/mooncake/ckpt/w0", os.O_RDWR|os.O_CREATE)
//	f.PutVM(b, 0)              // b, straight out of this process's memory
//	f.GetVM(b, 0)              // and back in
//	reg, _ := f.Register(memfd, 0, n)
//	f.PutBuf(reg.ID, 0, n, 0, 0)
//
// A put replaces the whole value atomically (FlagUpdate writes into a copy
// of it instead; FlagExcl: first writer wins) and needs a writable File. A
// File opened read-only reads the version current at its open for as long
// as it stays open; STAT describes the key's current version. Put, Get and
// GetAll do one whole value in one call.
//
// Registrations belong to the open file they were made on and die with it.
// Register memory once: a Pool is one memfd, registered once, cut into
// fixed-size slots that Lease hands out and Return takes back; when every
// slot is leased it fails (ErrPoolExhausted) or waits with a deadline, as
// PoolOptions say, and never registers more. Seal the size of memfds you
// register yourself (F_SEAL_SHRINK): the daemon maps their pages. Only
// memfds, shm (tmpfs) and hugetlbfs files can be registered; any other fd,
// a file of the mount itself above all, fails with EINVAL. One open file
// holds at most 1024 registrations, the mount 16384 and 8 TiB of them
// (EMFILE past them).
//
// Keys by name (ABI 1.3), on a File of a directory: PutKey/GetKey (and
// KeyCall, for any source) move one key in one small call, with a meta
// of up to MaxMeta bytes kept as the xattr user.mooncake.meta (a whole put
// sets it, none removing it; an update keeps it; a get that names a meta
// fails with EBADMSG unless the value's is the same); LookupKey returns
// size, version and meta. BatchPutV/BatchGetV take keys whose values are
// gathered from, and scattered into, several segments each: this
// process's memory (SegVM), registrations of the directory, or CUDA
// allocations of the call's GPU table named by IPC handle (SegGPU|i),
// which the daemon opens once per client process. RegisterCUDA registers
// GPU memory once (RegisterCUDADmabuf with a dma-buf of the allocation,
// for the daemon's GPUDirect RDMA), RegisterAddr this process's own
// memory by address.
// PutKey and GetKey move a value of up to InlineBytes inside the call
// (PUT_KEY_INLINE, GET_KEY_INLINE, ABI 1.9): the kernel's copy of a few
// kilobytes costs less than the daemon's process_vm_readv/writev into
// the caller, and nothing of the caller's memory is named; against an
// older daemon a File goes by address.
// A key by name may be a path below the directory; with FlagParents (ABI
// 1.4) its put makes the missing directories first. StartBatchPutV and
// StartBatchGetV (ABI 1.7) submit one vector batch and return while the
// daemon runs it; PendingV.Wait collects its results and WaitCalls waits
// for every call submitted on the File before it.
//
// BatchPut, BatchGet, BatchPutBuf and BatchGetBuf send their keys as table
// calls (ABI 1.8, BATCH_PUT_TABLE): the argument names the entries and
// keys in this process's memory, which the daemon reads, so one call
// carries up to BatchCallKeys (MaxTable) keys in one FUSE round trip. A
// batch of more keys than one call carries goes as calls up to
// BatchInFlight at once, when their order cannot show. Against a daemon
// before 1.8 a File falls back to BATCH_PUT/BATCH_GET calls of MaxBatch
// keys (so does every File with BatchTables false).
//
// PUT_VM and GET_VM copy with process_vm_readv/writev, which pin the
// caller's pages a folio at a time: buffers backed by transparent huge
// pages (madvise MADV_HUGEPAGE) move about twice as fast as 4 KiB pages.
// The daemon finds that memory by address, which the collector does not
// see: the calls that take Go slices keep them reachable until they
// return; a caller that passes an address itself (KeyCall, raw SegVM
// segments) must do the same (runtime.KeepAlive), and keep memory it
// registered by address (RegisterAddr) until it unregisters it, or the
// memory may belong to another allocation while the daemon copies.
//
// # Errors
//
// A failed command returns an error naming the command, the path and the
// arguments, wrapping the daemon's errno (errors.Is(err, unix.EEXIST)).
// A user other than root runs at most 256 data commands at once on a
// mount, and all such users 4096: past that a command fails with EBUSY
// (a command whose copy waits on memory that never answers holds one of
// the daemon's threads, which are finite).
// Batch commands succeed or fail per key (BatchResult.Err); the call
// itself fails only for a batch the daemon refused whole. Nothing is
// retried: the daemon runs every request it received to its end (FUSE
// interrupts do not cancel it), so no call returns EINTR for work left
// half done.
//
// # Invariants
//
// A lease is returned once. In builds with -tags invariants a second
// Return panics; otherwise it returns ErrDoubleReturn and changes nothing.
package ioctl
