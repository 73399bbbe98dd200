//go:build cgo

package rdma

// verbsHaveCgo: this test binary has the libibverbs binding, not the stub.
const verbsHaveCgo = true

// mirrorLayout returns layout.go's comparison of mc_verbs.h with
// <infiniband/verbs.h>, and whether that header was found at build time.
func mirrorLayout() ([]layoutRow, bool) { return layoutRows(), layoutHaveHeader() }
