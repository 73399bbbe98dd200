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
package ioctl
