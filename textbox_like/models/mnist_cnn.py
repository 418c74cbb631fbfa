"""HetSeq's MNIST network (the PyTorch examples CNN)."""
import torch
import torch.nn.functional as F
from torch import nn


class MNISTNet(nn.Module):
    def __init__(self, hidden=128, dropout1=0.25, dropout2=0.5):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        # HetSeq's: whole feature maps dropped after the convolutions (one
        # random number per channel, not per activation), then element-wise
        self.dropout1 = nn.Dropout2d(dropout1)
        self.dropout2 = nn.Dropout(dropout2)
        self.fc1 = nn.Linear(9216, hidden)
        self.fc2 = nn.Linear(hidden, 10)
        # channels-last convolutions: oneDNN (CPU) and cuDNN run them without
        # reordering to and from their native layout (~1.3x per update on CPU
        # together with the pooling order below); the values are the same
        self.to(memory_format=torch.channels_last)

    def forward(self, x):
        return self.head(self.features(x))

    def features(self, x):
        x = x.contiguous(memory_format=torch.channels_last)
        x = F.relu(self.conv1(x))
        # relu(max_pool(x)) == max_pool(relu(x)), on a quarter of the values
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        return torch.flatten(self.dropout1(x), 1)

    def head(self, x):
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), dim=1)

    def compile_regions(self, device_type):
        """What --compile compiles on this device (None: the whole net). On CPU
        only the fully connected head: the convolution block stays with oneDNN
        and ATen, because inductor's C++ for its pooling, relus and dropout (and
        their backward) made a whole update about 20% slower than eager on this
        project's AVX-512 test machine, with any layout and thread count tried.
        On CUDA the whole net compiles."""
        return ["head"] if device_type == "cpu" else None
