// Command gpucheck drives the GPU ioctls of a mounted mooncake-fs from a
// separate process and prints one line per check ("ok NAME" or "FAIL NAME:
// why"); it exits 1 if any check failed and 77 if there is no GPU.
//
//	gpucheck DIR          (DIR: a directory on the mount)
//	gpucheck child DIR    (internal: put a value and exit with handles open)
package main

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/mooncake-fs/mooncake-fs/cuda"
	"github.com/mooncake-fs/mooncake-fs/ioctl"
)

var failed bool

func check(name string, err error) {
	if err != nil {
		failed = true
		fmt.Printf("FAIL %s: %v\n", name, err)
		return
	}
	fmt.Printf("ok %s\n", name)
}

func pattern(n int, seed byte) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i*7) ^ seed ^ byte(i>>12)
	}
	return b
}

func main() {
	if err := cuda.Init(); err != nil {
		fmt.Println("skip: no CUDA:", err)
		os.Exit(77)
	}
	if len(os.Args) == 3 && os.Args[1] == "child" {
		child(os.Args[2])
		return
	}
	if len(os.Args) == 3 && os.Args[1] == "ipcchild" {
		ipcChild(os.Args[2])
		return
	}
	if len(os.Args) == 3 && os.Args[1] == "lat64" {
		latency64(os.Args[2])
		return
	}
	if len(os.Args) == 2 && os.Args[1] == "reglat" {
		regLatency()
		return
	}
	if len(os.Args) == 2 && os.Args[1] == "mstream" {
		multiStream()
		return
	}
	if len(os.Args) == 2 && os.Args[1] == "dmabuf" {
		dmabuf()
		return
	}
	if len(os.Args) == 3 && os.Args[1] == "dmabufchild" {
		dmabufChild(os.Args[2])
		return
	}
	if len(os.Args) == 2 && os.Args[1] == "ipclat" {
		ipcLatency()
		return
	}
	if len(os.Args) == 3 && os.Args[1] == "lat" {
		latency(os.Args[2])
		return
	}
	dir := os.Args[1]
	ctx, err := cuda.Retain(0)
	if err != nil {
		fmt.Println("FAIL retain:", err)
		os.Exit(1)
	}
	defer ctx.Release()
	const big = 32 << 20
	dev, err := ctx.MemAlloc(big)
	if err != nil {
		fmt.Println("FAIL alloc:", err)
		os.Exit(1)
	}
	defer ctx.MemFree(dev)
	h, err := ctx.IpcGetHandle(dev)
	check("ipc handle", err)

	// 1. Put 8 MiB that sit 1 MiB into the allocation.
	want := pattern(8<<20, 1)
	check("fill gpu", ctx.CopyHtoD(dev+1<<20, want))
	f, err := ioctl.Open(filepath.Join(dir, "t1"), os.O_RDWR|os.O_CREATE)
	if err != nil {
		fmt.Println("FAIL open:", err)
		os.Exit(1)
	}
	n, _, err := f.PutCUDA(ioctl.CUDAMem{Handle: h, Offset: 1 << 20}, 8<<20, 0, 0)
	check("put_cuda at an offset", errors.Join(err, count(n, 8<<20)))
	got := make([]byte, 8<<20)
	n, _, err = f.GetVM(got, 0)
	check("stored bytes are the GPU's", errors.Join(err, count(n, 8<<20), same(got, want)))

	// 2. Get into another place of the allocation, whole and partial.
	n, _, err = f.GetCUDA(ioctl.CUDAMem{Handle: h, Offset: 16 << 20}, 8<<20, 0)
	back := make([]byte, 8<<20)
	check("get_cuda", errors.Join(err, count(n, 8<<20), ctx.CopyDtoH(back, dev+16<<20), same(back, want)))
	n, _, err = f.GetCUDA(ioctl.CUDAMem{Handle: h, Offset: 30 << 20}, 1<<20, 3<<20)
	part := make([]byte, 1<<20)
	check("partial get_cuda", errors.Join(err, count(n, 1<<20), ctx.CopyDtoH(part, dev+30<<20), same(part, want[3<<20:4<<20])))
	n, _, err = f.GetCUDA(ioctl.CUDAMem{Handle: h, Offset: 0}, 1<<20, 8<<20-100)
	check("short get_cuda at the end", errors.Join(err, count(n, 100)))

	// 3. Out of the allocation: EFAULT, nothing changes.
	_, _, err = f.PutCUDA(ioctl.CUDAMem{Handle: h, Offset: big - 4096}, 8192, 0, 0)
	check("put past the allocation is EFAULT", wantErrno(err, syscall.EFAULT))
	n, _, _ = f.GetVM(got, 0)
	check("value unchanged after refusal", errors.Join(count(n, 8<<20), same(got, want)))

	// 4. A device pointer given to the host-memory ioctl fails cleanly.
	err = putVMRaw(f, uint64(dev), 4096)
	check("device pointer to PUT_VM fails", wantAnyErr(err))
	n, _, _ = f.GetVM(got, 0)
	check("value unchanged after device pointer", errors.Join(count(n, 8<<20), same(got, want)))

	// 5. Register the allocation once, then PUT_BUF/GET_BUF.
	reg := ioctl.RegisterArg{Kind: ioctl.KindCUDA, Len: 16 << 20, Offset: 16 << 20, Handle: h}
	raw := reg.Marshal()
	err = rawCall(f, ioctl.CmdRegisterBuffer, raw)
	_ = reg.Unmarshal(raw)
	check("register cuda buffer", err)
	if err == nil {
		n, _, err = f.PutBuf(reg.ID, 0, 8<<20, 0, 0)
		check("put_buf from gpu registration", errors.Join(err, count(n, 8<<20)))
		n, _, _ = f.GetVM(got, 0)
		check("put_buf stored the gpu bytes", errors.Join(count(n, 8<<20), same(got, want)))
		check("unregister", f.Unregister(reg.ID))
	}
	dmabufRegistration(ctx, f, dev, big, h, want)
	f.Close()

	// 6. A child puts from its GPU memory and exits with its handle open:
	// the daemon closes what it opened for the child once it is gone.
	root := filepath.Dir(dir)
	before, err := clients(root)
	check("status before the child", errors.Join(err, errIf(before.Procs < 1 || before.IPC < 1,
		fmt.Sprintf("this process should have state and a handle open: %+v", before))))
	out, err := exec.Command(os.Args[0], "child", dir).CombinedOutput()
	check("child put", errors.Join(err, errIf(!bytes.Contains(out, []byte("child ok")), string(out))))
	var after clientStats
	for i := 0; i < 100; i++ {
		if after, err = clients(root); err != nil || (after.Procs == before.Procs && after.IPC == before.IPC) {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	check("the exited child's IPC handles are closed", errors.Join(err, errIf(after != before,
		fmt.Sprintf("before the child %+v, after %+v", before, after))))
	g, err := ioctl.Open(filepath.Join(dir, "t-child"), os.O_RDONLY)
	if err == nil {
		n, _, err = g.GetVM(got[:4<<20], 0)
		g.Close()
	}
	check("value of an exited child", errors.Join(err, count(n, 4<<20), same(got[:4<<20], pattern(4<<20, 9))))

	// 7. One key by name from GPU memory (PUT_KEY, SrcCUDA) with a meta;
	// a get asking for another meta moves nothing.
	dd, err := ioctl.OpenDir(dir)
	if err != nil {
		fmt.Println("FAIL opendir:", err)
		os.Exit(1)
	}
	defer dd.Close()
	ref := ioctl.GPURef{Handle: h}
	ka := ioctl.KeyArg{Source: ioctl.SrcCUDA, GPU: ref, Addr: 1 << 20, Len: 8 << 20, MetaLen: 3}
	copy(ka.Meta[:], "gpu")
	err = dd.KeyCall(true, "k1", &ka)
	check("put_key from gpu", errors.Join(err, count(ka.Result, 8<<20)))
	zero := make([]byte, 8<<20)
	check("clear gpu", ctx.CopyHtoD(dev+20<<20, zero))
	kg := ioctl.KeyArg{Source: ioctl.SrcCUDA, GPU: ref, Addr: 20 << 20, Len: 8 << 20, MetaLen: 3}
	copy(kg.Meta[:], "cpu")
	err = dd.KeyCall(false, "k1", &kg)
	check("get_key with another meta is EBADMSG", errors.Join(wantErrno(err, syscall.EBADMSG),
		ctx.CopyDtoH(back, dev+20<<20), same(back, zero)))
	copy(kg.Meta[:], "gpu")
	err = dd.KeyCall(false, "k1", &kg)
	check("get_key into gpu", errors.Join(err, count(kg.Result, 8<<20), count(kg.ObjSize, 8<<20),
		ctx.CopyDtoH(back, dev+20<<20), same(back, want)))

	// 8. A vector batch gathering keys from two allocations named by
	// their IPC handles, and scattering them back into a third place.
	dev2, err := ctx.MemAlloc(4 << 20)
	check("alloc 2", err)
	if err == nil {
		defer ctx.MemFree(dev2)
		p2 := pattern(4<<20, 5)
		check("fill gpu 2", ctx.CopyHtoD(dev2, p2))
		h2, err := ctx.IpcGetHandle(dev2)
		check("ipc handle 2", err)
		gpus := []ioctl.GPURef{{Handle: h}, {Handle: h2}}
		items := []ioctl.VItem{
			{Key: "v1", Segs: []ioctl.Seg{{ID: ioctl.SegGPU | 0, Off: 1 << 20, Len: 1 << 20}, {ID: ioctl.SegGPU | 1, Off: 0, Len: 4 << 20}}},
			{Key: "v2", Segs: []ioctl.Seg{{ID: ioctl.SegGPU | 1, Off: 1 << 20, Len: 1 << 20}}},
			{Key: "v3", Segs: []ioctl.Seg{{ID: ioctl.SegGPU | 1, Off: 4<<20 - 10, Len: 11}}},
		}
		res, err := dd.BatchPutV(gpus, items)
		if err == nil {
			err = errors.Join(res[0].Err, count(res[0].N, 5<<20), res[1].Err, count(res[1].N, 1<<20), wantErrno(res[2].Err, syscall.EFAULT))
		}
		check("batch_putv from two allocations", err)
		v := make([]byte, 5<<20)
		r, _, err := dd.GetKey("v1", v, 0)
		check("gathered value", errors.Join(err, count(r, 5<<20), same(v[:1<<20], want[:1<<20]), same(v[1<<20:], p2)))
		check("clear gpu", ctx.CopyHtoD(dev+20<<20, zero))
		back := []ioctl.VItem{{Key: "v1", Segs: []ioctl.Seg{{ID: ioctl.SegGPU | 0, Off: 20 << 20, Len: 2 << 20}, {ID: ioctl.SegGPU | 0, Off: 24 << 20, Len: 4 << 20}}}}
		res, err = dd.BatchGetV(gpus[:1], back)
		if err == nil {
			err = errors.Join(res[0].Err, count(res[0].N, 5<<20))
		}
		g1, g2 := make([]byte, 2<<20), make([]byte, 3<<20)
		check("batch_getv scattered into gpu", errors.Join(err, ctx.CopyDtoH(g1, dev+20<<20), ctx.CopyDtoH(g2, dev+24<<20),
			same(g1, v[:2<<20]), same(g2, v[2<<20:])))
		if st, err := clients(root); err == nil && st.IPC < 2 {
			check("both allocations are open for this process", fmt.Errorf("%+v", st))
		}
	}
	// 9. Blocks adjacent in GPU memory and in the store go as merged
	// copies: 48 keys of 16 KiB from consecutive blocks (one of them past
	// the allocation: EFAULT alone, the run split around it), read back
	// into consecutive blocks and in reverse order, every byte checked.
	{
		const blk, nk = 16 << 10, 48
		gpus := []ioctl.GPURef{{Handle: h}}
		var items []ioctl.VItem
		for k := range nk {
			off := uint64(1<<20 + k*blk)
			if k == 20 {
				off = big - blk/2
			}
			items = append(items, ioctl.VItem{Key: fmt.Sprintf("m%d", k), Segs: []ioctl.Seg{{ID: ioctl.SegGPU | 0, Off: off, Len: blk}}})
		}
		before, serr := gpuCopies(root)
		res, err := dd.BatchPutV(gpus, items)
		after, aerr := gpuCopies(root)
		check("status shows the GPU copies", errors.Join(serr, aerr))
		if pieces, copies := after.GPUPieces-before.GPUPieces, after.GPUCopies-before.GPUCopies; pieces != nk-1 || copies*2 > pieces {
			// 47 pieces, in chunks of 16 split by the failed key: four
			// copies where the store's free space is in one piece.
			check("neighbouring blocks merged", fmt.Errorf("%d pieces went as %d copies", pieces, copies))
		}
		for k := 0; err == nil && k < nk; k++ {
			if k == 20 {
				err = wantErrno(res[k].Err, syscall.EFAULT)
			} else {
				err = errors.Join(res[k].Err, count(res[k].N, blk))
			}
		}
		check("merged batch put", err)
		v := make([]byte, blk)
		for k := 0; err == nil && k < nk; k++ {
			if k == 20 {
				continue
			}
			var r uint64
			r, _, err = dd.GetKey(fmt.Sprintf("m%d", k), v, 0)
			err = errors.Join(err, count(r, blk), same(v, want[k*blk:(k+1)*blk]))
		}
		check("merged put stored each block", err)
		for _, reverse := range []bool{false, true} {
			check("clear gpu", ctx.CopyHtoD(dev+20<<20, zero))
			var back []ioctl.VItem
			for k := range nk {
				if k == 20 {
					continue
				}
				at := k
				if reverse {
					at = nk - 1 - k
				}
				back = append(back, ioctl.VItem{Key: fmt.Sprintf("m%d", k), Segs: []ioctl.Seg{{ID: ioctl.SegGPU | 0, Off: uint64(20<<20 + at*blk), Len: blk}}})
			}
			res, err := dd.BatchGetV(gpus, back)
			for k := 0; err == nil && k < len(back); k++ {
				err = errors.Join(res[k].Err, count(res[k].N, blk))
			}
			out := make([]byte, nk*blk)
			if err == nil {
				err = ctx.CopyDtoH(out, dev+20<<20)
			}
			for k := 0; err == nil && k < nk; k++ {
				if k == 20 {
					continue
				}
				at := k
				if reverse {
					at = nk - 1 - k
				}
				err = same(out[at*blk:(at+1)*blk], want[k*blk:(k+1)*blk])
			}
			check(fmt.Sprintf("merged batch get (reverse %v)", reverse), err)
		}
	}
	// 10. The batch figures' commit time leaves the copies' waits out: 32
	// keys of 1 MiB from GPU memory wait about a millisecond for their
	// copies, and commit in a small part of that.
	{
		const blk, nk = 1 << 20, 32
		var items []ioctl.VItem
		for k := range nk {
			items = append(items, ioctl.VItem{Key: fmt.Sprintf("w%d", k), Segs: []ioctl.Seg{{ID: ioctl.SegGPU | 0, Off: uint64(k * blk), Len: blk}}})
		}
		before, berr := status(root)
		res, err := dd.BatchPutV([]ioctl.GPURef{{Handle: h}}, items)
		after, aerr := status(root)
		for k := 0; err == nil && k < nk; k++ {
			err = errors.Join(res[k].Err, count(res[k].N, blk))
		}
		check("batch put of 1 MiB blocks", errors.Join(err, berr, aerr))
		b, a := before.Batches, after.Batches
		commit, work, transfer := a.CommitNs-b.CommitNs, (a.HandlerNs-b.HandlerNs)-(a.TransferNs-b.TransferNs), a.TransferNs-b.TransferNs
		check("commit time is work, not waits", errIf(commit == 0 || commit > work,
			fmt.Sprintf("%d ns committing, %d ns of work, %d ns in transfers", commit, work, transfer)))
	}
	if failed {
		os.Exit(1)
	}
	fmt.Println("PASS")
}

func child(dir string) {
	ctx, err := cuda.Retain(0)
	if err != nil {
		fmt.Println(err)
		os.Exit(1)
	}
	dev, err := ctx.MemAlloc(4 << 20)
	if err == nil {
		err = ctx.CopyHtoD(dev, pattern(4<<20, 9))
	}
	var h [64]byte
	if err == nil {
		h, err = ctx.IpcGetHandle(dev)
	}
	var f *ioctl.File
	if err == nil {
		f, err = ioctl.Open(filepath.Join(dir, "t-child"), os.O_RDWR|os.O_CREATE)
	}
	if err == nil {
		_, _, err = f.PutCUDA(ioctl.CUDAMem{Handle: h}, 4<<20, 0, 0)
	}
	if err != nil {
		fmt.Println(err)
		os.Exit(1)
	}
	fmt.Println("child ok")
	os.Exit(0) // no close, no free: the kernel and the driver clean up
}

// clientStats is the "clients" part of the daemon's status.
type clientStats struct {
	Procs int `json:"procs"`
	IPC   int `json:"ipc_handles"`
}

// copyStats is the daemon's GPU copy counters, in its "transfer" part.
type copyStats struct {
	GPUPieces, GPUCopies uint64
}

// batchStats is the daemon's batch figures, in its "batches" part.
type batchStats struct {
	HandlerNs  uint64 `json:"handler_ns"`
	TransferNs uint64 `json:"transfer_ns"`
	CommitNs   uint64 `json:"commit_ns"`
}

// daemonStatus is the parts of the status the checks read.
type daemonStatus struct {
	Clients  clientStats `json:"clients"`
	Transfer copyStats   `json:"transfer"`
	Batches  batchStats  `json:"batches"`
}

// status reads the daemon's status from the mount root's attribute.
func status(root string) (daemonStatus, error) {
	b, err := ioctl.ReadStatus(root)
	if err != nil {
		return daemonStatus{}, err
	}
	var s daemonStatus
	err = json.Unmarshal(b, &s)
	return s, err
}

// gpuCopies reads the daemon's GPU copy counters.
func gpuCopies(root string) (copyStats, error) {
	s, err := status(root)
	return s.Transfer, err
}

// clients reads the daemon's client figures.
func clients(root string) (clientStats, error) {
	s, err := status(root)
	return s.Clients, err
}

func count(n, want uint64) error {
	if n != want {
		return fmt.Errorf("moved %d B, want %d", n, want)
	}
	return nil
}

func same(got, want []byte) error {
	if !bytes.Equal(got, want) {
		for i := range got {
			if got[i] != want[i] {
				return fmt.Errorf("byte %d is %#x, want %#x", i, got[i], want[i])
			}
		}
	}
	return nil
}

func errIf(bad bool, why string) error {
	if bad {
		return errors.New(why)
	}
	return nil
}

func wantErrno(err error, e syscall.Errno) error {
	if !errors.Is(err, e) {
		return fmt.Errorf("got %v, want %v", err, e)
	}
	return nil
}

func wantAnyErr(err error) error {
	if err == nil {
		return errors.New("accepted")
	}
	fmt.Printf("   (device pointer refused with: %v)\n", err)
	return nil
}

func putVMRaw(f *ioctl.File, addr, n uint64) error {
	a := ioctl.VMArg{Addr: addr, Len: n}
	return rawCall(f, ioctl.CmdPutVM, a.Marshal())
}

func rawCall(f *ioctl.File, cmd uint32, b []byte) error {
	_, _, e := syscall.Syscall(syscall.SYS_IOCTL, f.OS().Fd(), uintptr(cmd), uintptr(unsafe.Pointer(&b[0])))
	if e != 0 {
		return e
	}
	return nil
}

// latency prints the per-call cost of the GPU ioctls next to a bare ioctl
// round trip and the driver's own copy, to see what a call adds.
func latency(dir string) {
	ctx, dev, m, f := latSetup(dir, "lat")
	host := make([]byte, 64<<20)
	timeit := func(name string, n int, fn func()) {
		fn()
		t0 := time.Now()
		for range n {
			fn()
		}
		fmt.Printf("%-28s %8.1f us\n", name, float64(time.Since(t0).Microseconds())/float64(n))
	}
	timeit("stat ioctl", 500, func() { _, _ = f.Stat() })
	timeit("put_cuda 4KiB", 300, func() { _, _, _ = f.PutCUDA(m, 4096, 0, 0) })
	timeit("get_cuda 4KiB", 300, func() { _, _, _ = f.GetCUDA(m, 4096, 0) })
	timeit("cuMemcpyDtoH 4KiB (pageable)", 300, func() { _ = ctx.CopyDtoH(host[:4096], dev) })
	timeit("put_cuda 64MiB", 30, func() { _, _, _ = f.PutCUDA(m, 64<<20, 0, 0) })
	timeit("get_cuda 64MiB", 30, func() { _, _, _ = f.GetCUDA(m, 64<<20, 0) })
	_ = ctx.HostRegister(host, cuda.HostRegisterPortable)
	timeit("cuMemcpyDtoH 64MiB pinned", 30, func() { _ = ctx.CopyDtoH(host, dev) })
	timeit("cuMemcpyHtoD 64MiB pinned", 30, func() { _ = ctx.CopyHtoD(dev, host) })
	// The same into hugetlb memory registered like the daemon's segments.
	huge, err := syscall.Mmap(-1, 0, 64<<20, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANONYMOUS|0x40000)
	if err != nil {
		fmt.Println("no hugetlb mapping:", err)
		return
	}
	for i := 0; i < len(huge); i += 4096 {
		huge[i] = 1
	}
	if err := ctx.HostRegister(huge, cuda.HostRegisterPortable); err != nil {
		fmt.Println("register hugetlb:", err)
		return
	}
	timeit("cuMemcpyDtoH 64MiB hugetlb", 30, func() { _ = ctx.CopyDtoH(huge, dev) })
	timeit("cuMemcpyHtoD 64MiB hugetlb", 30, func() { _ = ctx.CopyHtoD(dev, huge) })
	s, _ := ctx.NewStream()
	timeit("async DtoH+sync 64MiB hugetlb", 30, func() { _ = cuda.CopyDtoHAsync(huge, dev, s); _ = s.Sync() })
	timeit("async 2x32MiB DtoH+sync hugetlb", 30, func() {
		_ = cuda.CopyDtoHAsync(huge[:32<<20], dev, s)
		_ = cuda.CopyDtoHAsync(huge[32<<20:], dev+32<<20, s)
		_ = s.Sync()
	})
}

// ipcLatency times the driver's pinned copies against memory of another
// process opened through its IPC handle, the way the daemon reaches a
// client's tensors, next to the same copies on the owner's side.
func ipcLatency() {
	ctx, err := cuda.Retain(0)
	if err != nil {
		fmt.Println(err)
		os.Exit(1)
	}
	dev, _ := ctx.MemAlloc(64 << 20)
	h, _ := ctx.IpcGetHandle(dev)
	out, err := exec.Command(os.Args[0], "ipcchild", fmt.Sprintf("%x", h[:])).CombinedOutput()
	fmt.Print(string(out))
	if err != nil {
		fmt.Println("ipcchild:", err)
	}
}

// openHandle opens the IPC handle in hex on device 0, or exits.
func openHandle(hexHandle string) (*cuda.Context, cuda.DevicePtr) {
	var h [64]byte
	b, err := hex.DecodeString(hexHandle)
	if err != nil || len(b) != len(h) {
		fmt.Println("bad handle:", err)
		os.Exit(1)
	}
	copy(h[:], b)
	ctx, err := cuda.Retain(0)
	if err != nil {
		fmt.Println(err)
		os.Exit(1)
	}
	p, err := ctx.IpcOpen(h)
	if err != nil {
		fmt.Println("ipc open:", err)
		os.Exit(1)
	}
	return ctx, p
}

func ipcChild(hexHandle string) {
	ctx, p := openHandle(hexHandle)
	own, _ := ctx.MemAlloc(64 << 20)
	host, _ := syscall.Mmap(-1, 0, 64<<20, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANONYMOUS)
	for i := 0; i < len(host); i += 4096 {
		host[i] = 1
	}
	_ = ctx.HostRegister(host, cuda.HostRegisterPortable)
	timeit := func(name string, fn func() error) {
		_ = fn()
		t0 := time.Now()
		for range 30 {
			if err := fn(); err != nil {
				fmt.Println(name, err)
				return
			}
		}
		fmt.Printf("%-30s %8.1f us\n", name, float64(time.Since(t0).Microseconds())/30)
	}
	timeit("DtoH 64MiB own allocation", func() error { return ctx.CopyDtoH(host, own) })
	timeit("DtoH 64MiB IPC-opened", func() error { return ctx.CopyDtoH(host, p) })
	timeit("HtoD 64MiB own allocation", func() error { return ctx.CopyHtoD(own, host) })
	timeit("HtoD 64MiB IPC-opened", func() error { return ctx.CopyHtoD(p, host) })
}

// dmabufRegistration registers the allocation dev (size bytes, IPC
// handle h) with a dma-buf of it (RegisterDmabuf, for the daemon's
// GPUDirect RDMA) and moves bytes through the registration; a descriptor
// that is no dma-buf, or a dma-buf of another size, is EINVAL (one of
// another allocation of the same size cannot be told apart: it is the
// caller's own memory either way).
func dmabufRegistration(ctx *cuda.Context, f *ioctl.File, dev cuda.DevicePtr, size uint64, h [64]byte, want []byte) {
	fd, err := ctx.ExportDmabuf(dev, size)
	if err != nil {
		fmt.Println("  skip dma-buf registration: the driver exports none:", err)
		return
	}
	defer syscall.Close(fd)
	reg, err := f.RegisterCUDADmabuf(h, fd, 16<<20, 8<<20)
	check("register cuda buffer with its dma-buf", err)
	if err == nil {
		n, _, err := f.PutBuf(reg.ID, 0, 8<<20, 0, 0)
		got := make([]byte, 8<<20)
		m, _, gerr := f.GetVM(got, 0)
		check("put_buf through the dma-buf registration", errors.Join(err, count(n, 8<<20), gerr, count(m, 8<<20), same(got, want)))
		check("unregister the dma-buf registration", f.Unregister(reg.ID))
	}
	mfd, err := unix.MemfdCreate("not-a-dmabuf", unix.MFD_CLOEXEC)
	check("memfd", err)
	_ = unix.Ftruncate(mfd, int64(size))
	_, err = f.RegisterCUDADmabuf(h, mfd, 0, 4096)
	check("a memfd as the dma-buf is EINVAL", wantErrno(err, syscall.EINVAL))
	syscall.Close(mfd)
	other, err := ctx.MemAlloc(4 << 20)
	check("alloc", err)
	ofd, err := ctx.ExportDmabuf(other, 4<<20)
	check("dma-buf of another allocation", err)
	_, err = f.RegisterCUDADmabuf(h, ofd, 0, 4096)
	check("a dma-buf of another size is EINVAL", wantErrno(err, syscall.EINVAL))
	syscall.Close(ofd)
	ctx.MemFree(other)
	_, err = f.RegisterCUDADmabuf(h, -1, 0, 4096)
	check("dma-buf fd -1 is EINVAL", wantErrno(err, syscall.EINVAL))
}

// dmabuf reports whether the driver exports device memory as dma-buf
// (what GPUDirect RDMA registers): an allocation of this process, and
// one opened from another process by IPC handle, as the daemon does.
func dmabuf() {
	ctx, err := cuda.Retain(0)
	if err != nil {
		fmt.Println(err)
		os.Exit(1)
	}
	dev, err := ctx.MemAlloc(64 << 20)
	if err != nil {
		fmt.Println(err)
		os.Exit(1)
	}
	fd, err := ctx.ExportDmabuf(dev, 64<<20)
	fmt.Printf("dma-buf of an own allocation: fd %d, %v\n", fd, err)
	if fd >= 0 {
		syscall.Close(fd)
	}
	h, _ := ctx.IpcGetHandle(dev)
	out, err := exec.Command(os.Args[0], "dmabufchild", fmt.Sprintf("%x", h[:])).CombinedOutput()
	fmt.Print(string(out))
	if err != nil {
		fmt.Println("dmabufchild:", err)
	}
}

func dmabufChild(hexHandle string) {
	ctx, p := openHandle(hexHandle)
	fd, err := ctx.ExportDmabuf(p, 64<<20)
	fmt.Printf("dma-buf of an IPC-opened allocation: fd %d, %v\n", fd, err)
	if fd >= 0 {
		syscall.Close(fd)
	}
}

// regLatency times 64 MiB pinned copies against host regions registered
// whole, small and large, hugetlb and 4 KiB pages: does the size of a
// registration (the daemon registers GiB-sized segments) slow a copy?
func regLatency() {
	ctx, err := cuda.Retain(0)
	if err != nil {
		fmt.Println(err)
		os.Exit(1)
	}
	const n = 64 << 20
	dev, _ := ctx.MemAlloc(n)
	s, _ := ctx.NewStream()
	for _, c := range []struct {
		name string
		size int
		huge bool
	}{{"hugetlb 64MiB", n, true}, {"hugetlb 2GiB", 2 << 30, true}, {"4KiB 64MiB", n, false}, {"4KiB 2GiB", 2 << 30, false}} {
		flags := syscall.MAP_PRIVATE | syscall.MAP_ANONYMOUS
		if c.huge {
			flags |= 0x40000 // MAP_HUGETLB
		}
		mem, err := syscall.Mmap(-1, 0, c.size, syscall.PROT_READ|syscall.PROT_WRITE, flags)
		if err != nil {
			fmt.Println(c.name, "mmap:", err)
			continue
		}
		for i := 0; i < len(mem); i += 4096 {
			mem[i] = 1
		}
		t0 := time.Now()
		if err := ctx.HostRegister(mem, cuda.HostRegisterPortable); err != nil {
			fmt.Println(c.name, "register:", err)
			syscall.Munmap(mem)
			continue
		}
		fmt.Printf("%-16s registered in %v\n", c.name, time.Since(t0))
		for _, off := range []int{0, c.size - n} {
			b := mem[off : off+n]
			timeit := func(what string, fn func()) {
				fn()
				t0 := time.Now()
				for range 30 {
					fn()
				}
				fmt.Printf("  %-16s off %4d MiB %-22s %8.1f us\n", c.name, off>>20, what, float64(time.Since(t0).Microseconds())/30)
			}
			timeit("DtoH", func() { _ = ctx.CopyDtoH(b, dev) })
			timeit("HtoD", func() { _ = ctx.CopyHtoD(dev, b) })
			timeit("async DtoH+sync", func() { _ = cuda.CopyDtoHAsync(b, dev, s); _ = s.Sync() })
			if off == c.size-n {
				break
			}
		}
		_ = ctx.HostUnregister(mem)
		syscall.Munmap(mem)
	}
}

// latency64 runs only 64 MiB put_cuda and get_cuda calls, 30 each after one
// untimed call, so that the daemon's metrics and log can be read as the
// cost of exactly those calls.
func latency64(dir string) {
	_, _, m, f := latSetup(dir, "lat64")
	for _, c := range []struct {
		name string
		fn   func()
	}{{"put_cuda 64MiB", func() { _, _, _ = f.PutCUDA(m, 64<<20, 0, 0) }}, {"get_cuda 64MiB", func() { _, _, _ = f.GetCUDA(m, 64<<20, 0) }}} {
		c.fn()
		t0 := time.Now()
		for range 30 {
			c.fn()
		}
		fmt.Printf("%-28s %8.1f us\n", c.name, float64(time.Since(t0).Microseconds())/30)
	}
}

// latSetup allocates 64 MiB on the first GPU and opens dir/name for the
// latency runs; it exits on failure.
func latSetup(dir, name string) (*cuda.Context, cuda.DevicePtr, ioctl.CUDAMem, *ioctl.File) {
	ctx, err := cuda.Retain(0)
	if err != nil {
		fmt.Println(err)
		os.Exit(1)
	}
	dev, _ := ctx.MemAlloc(64 << 20)
	h, _ := ctx.IpcGetHandle(dev)
	f, err := ioctl.Open(filepath.Join(dir, name), os.O_RDWR|os.O_CREATE)
	if err != nil {
		fmt.Println(err)
		os.Exit(1)
	}
	return ctx, dev, ioctl.CUDAMem{Handle: h}, f
}

// multiStream times one copy of 64 MiB and 1 GiB split into k contiguous
// slices on k streams at once: does more than one copy engine in the same
// direction beat a single cuMemcpy over the same link?
func multiStream() {
	ctx, err := cuda.Retain(0)
	if err != nil {
		fmt.Println(err)
		os.Exit(1)
	}
	const most = 1 << 30
	dev, _ := ctx.MemAlloc(most)
	huge, err := syscall.Mmap(-1, 0, most, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANONYMOUS|0x40000)
	if err != nil {
		huge, _ = syscall.Mmap(-1, 0, most, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANONYMOUS)
	}
	for i := 0; i < len(huge); i += 4096 {
		huge[i] = 1
	}
	if err := ctx.HostRegister(huge, cuda.HostRegisterPortable); err != nil {
		fmt.Println("register:", err)
		return
	}
	var ss []*cuda.Stream
	for range 8 {
		s, _ := ctx.NewStream()
		ss = append(ss, s)
	}
	for _, n := range []int{64 << 20, 256 << 20, most} {
		iters := max(4, (2<<30)/n)
		for _, dtoh := range []bool{true, false} {
			for _, k := range []int{1, 2, 3, 4, 8} {
				run := func() {
					part := n / k
					for i := range k {
						h := huge[i*part : (i+1)*part]
						d := dev + cuda.DevicePtr(i*part)
						if dtoh {
							_ = cuda.CopyDtoHAsync(h, d, ss[i])
						} else {
							_ = cuda.CopyHtoDAsync(d, h, ss[i])
						}
					}
					for i := range k {
						_ = ss[i].Sync()
					}
				}
				run()
				t0 := time.Now()
				for range iters {
					run()
				}
				us := float64(time.Since(t0).Microseconds()) / float64(iters)
				fmt.Printf("mstream %5d MiB dtoh=%-5v k=%d %9.1f us %6.2f GB/s\n", n>>20, dtoh, k, us, float64(n)/us/1e3)
			}
		}
	}
}
