package transfer

import "errors"

var (
	ErrBadRequest = errors.New("transfer: bad request")
	ErrNoStrategy = errors.New("transfer: no strategy for request")
	ErrClosed     = errors.New("transfer: engine closed")
)
