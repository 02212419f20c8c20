package closereview_test

import (
	"testing"

	"github.com/slotbook/slotbook/internal/redistest"
)

func TestMain(m *testing.M) { redistest.Main(m) }
